"""The errors ``nx.xmap`` raises for its arguments and for what JAX refuses
in its program, each saying what is wrong and how to fix it."""
from __future__ import annotations

import difflib
from typing import Any

import jax

from nxops._errors import NxopsError
from nxops._jax import ArrayImpl as _ArrayImpl
from nxops._jax import spmd_axis_names
from nxops.xmap._plan import Plan


def missing_out_names_error(missing: list, defined: list, in_axes: Any,
                             out_axes: Any) -> NxopsError:
    """out_axes names no input or axis_sizes defines: likely misspelled when
    close to a defined name, else a broadcast result that needs its size."""
    spelled = {n: difflib.get_close_matches(str(n), map(str, defined), n=1) for n in missing}
    if any(spelled.values()):
        guesses = "; ".join(f"did you mean {close[0]!r} for {name!r}?" if close
                            else f"{name!r} is like no input name"
                            for name, close in spelled.items())
        return NxopsError(
            f"out_axes={quote(out_axes)} names {', '.join(map(repr, missing))}, which "
            f"in_axes={quote(in_axes)} does not: {guesses} Fix the spelling; a result "
            f"broadcast along a new name needs its size in axis_sizes={{name: size}}.")
    return NxopsError(
        f"All axis names appearing in out_axes must also appear in in_axes or "
        f"axis_sizes, but the following are missing: {', '.join(map(repr, missing))} "
        f"(out_axes={quote(out_axes)}). Give their sizes with axis_sizes={{name: size}}.")


def closed_over_error(constants: list, plan: Plan) -> NxopsError:
    shown = ", ".join(f"{c.dtype}{list(c.shape)}" for c in constants)
    return NxopsError(
        f"The xmapped function closes over arrays made under a mesh with Explicit axes "
        f"({shown}) and uses them where JAX cannot inside the shard_map over mesh axes "
        f"{plan.mesh_axes}: values typed on the all-Explicit mesh do not mix with the "
        f"body's partly Manual one (jax-ml/jax#29162). Pass them to the xmapped function "
        f"as arguments (in_axes [...] replicates one), or make them outside jax.set_mesh.")


def closing_over_explicit(error: Exception) -> bool:
    """Whether ``error`` is JAX's refusal to close over a value typed on Explicit
    mesh axes inside a shard_map."""
    return isinstance(error, NotImplementedError) and "Closing over inputs to shard_map" in str(error)


def mixing_mesh_types(error: Exception) -> bool:
    """Whether ``error`` is JAX's refusal to mix a value typed on the all-Explicit
    mesh (a tracer of an enclosing jax.jit or jax.vmap) with the body's values."""
    return isinstance(error, ValueError) and "should match the aval mesh" in str(error)


def closed_over_tracer_error(plan: Plan) -> NxopsError:
    return NxopsError(
        f"The xmapped function closes over a value traced outside it (by an enclosing "
        f"jax.jit, jax.vmap or jax.grad) and typed on the mesh with Explicit axes, and uses "
        f"it inside the shard_map over mesh axes {plan.mesh_axes}, where JAX "
        f"{jax.__version__} cannot mix it with the body's values (their mesh axes are "
        f"Manual there). Pass the value to the xmapped function as an argument instead "
        f"(in_axes [...] gives every position the same value), or map the names to no "
        f"mesh axis.")


def nested_closure_error(plan: Plan) -> NxopsError:
    return NxopsError(
        f"This nested xmap maps its names to mesh axes {plan.mesh_axes}, which the enclosing "
        f"xmap leaves to JAX (Explicit axes), and its body closes over a value of the "
        f"enclosing body: JAX {jax.__version__} cannot close over such a value inside the "
        f"nested xmap's shard_map (NotImplementedError: 'Closing over inputs to shard_map "
        f"where the input is sharded on Explicit axes'). Pass the value to the nested xmap "
        f"as an argument instead (in_axes [...] gives every position the same value), or map "
        f"the nested names to no mesh axis.")


def quote(spec: Any) -> str:
    return repr(spec).replace("Ellipsis", "...")


def non_array_argument_error(args: tuple) -> NxopsError | None:
    """The error for an argument that is not an array (a str, an object), if any."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        try:
            jax.typeof(leaf)
        except TypeError:
            return NxopsError(
                f"xmap argument args{jax.tree_util.keystr(path)} is of type {type(leaf).__name__} "
                f"({leaf!r:.60}), not an array: xmapped functions take arrays, scalars "
                f"and pytrees of them. Close over other values (functools.partial or a "
                f"lambda) instead of passing them.")
    return None


def explained_value_error(error: ValueError, args: tuple) -> NxopsError | None:
    """What a ValueError of JAX's means for this call, when nxops knows."""
    if isinstance(error, NxopsError):
        return None
    if spmd_axis_names() and "verifier errors" in str(error):
        return NxopsError(
            f"JAX {jax.__version__} cannot lower this xmap under jax.vmap(..., "
            f"spmd_axis_name={sorted(spmd_axis_names())}): its shard_map batching rule "
            "builds a manual computation whose shapes do not match (a JAX bug; JAX "
            "0.10.2 lowers it). Map the vmapped dimension as a named axis of the xmap "
            "instead (in_axes/out_axes with axis_resources on that mesh axis).")
    if jax.process_count() > 1 and process_local_inputs(args):
        return NxopsError(
            "In a program over several processes, every nx.xmap input must be a global "
            "jax.Array on the mesh, but some inputs live on this process's devices only. "
            "Build them with jax.make_array_from_process_local_data(sharding, local_data) "
            "or jax.make_array_from_callback(shape, sharding, callback), with sharding = "
            "NamedSharding(mesh, PartitionSpec(...)).")
    return None


def process_local_inputs(args: tuple) -> bool:
    """Whether some committed input lives on this process's devices only."""
    return any(isinstance(x, _ArrayImpl) and x.committed and x.is_fully_addressable
               for x in jax.tree.leaves(args))
