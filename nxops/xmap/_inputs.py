"""An ``nx.xmap`` call's inputs against the mesh: where each belongs under the
plan, which live elsewhere (other devices, another mesh) and are moved, and
which a trace must refuse."""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nxops._errors import NxopsError
from nxops._jax import ArrayImpl as _ArrayImpl
from nxops._jax import mesh_lib as _mesh_lib
from nxops.xmap._definition import Definition
from nxops.xmap._plan import Plan, mesh_in_scope


def full_rank(sharding: NamedSharding, ndim: int) -> NamedSharding:
    """``sharding`` with its spec padded to ``ndim`` entries: jit returns
    results with full-rank specs, and ``P('mp')`` differs from ``P('mp', None)``
    in jit's cache key, so an argument placed with the short one and fed back
    from a step's result would compile the step twice."""
    spec = tuple(sharding.spec)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec, *[None] * (ndim - len(spec))))


def _untyped_by_stale_mesh(x):
    """``x``, copied if its type names a mesh its devices are not (``device_put(y,
    device)`` of an array made under ``jax.set_mesh`` keeps the mesh in the
    type): JAX cannot move such an array onto a mesh ("Length of device
    assignment 1 is not equal to the size of the mesh"); the copy, typed
    on no mesh, moves."""
    if isinstance(x.sharding, NamedSharding) or jax.typeof(x).sharding.mesh.empty:
        return x
    return jax.device_put(x, x.sharding, may_alias=False)


def as_array(x: Any) -> Any:
    """An argument as jax.jit passes it on (Python scalars weakly typed)."""
    return x if isinstance(x, jax.Array) else jax.numpy.asarray(x)


def committed_elsewhere(args: tuple) -> bool:
    """Whether some input is committed elsewhere than the mesh in scope."""
    mesh = mesh_in_scope()
    return mesh is not None and any(_elsewhere(x, mesh) for x in jax.tree.leaves(args))


def _elsewhere(x, mesh: Mesh) -> bool:
    """Whether ``x`` is an array committed elsewhere than ``mesh``: to other
    devices (a subset, or outside it), or sharded or typed on another mesh of
    them (other axis names, sizes, device order or axis types). Such an input
    is moved onto ``mesh`` before the program runs: one program holding both
    meshes is refused by JAX, or aborts the process in XLA (Shardy makes the
    other mesh's axes sub-axes of the program's, and a manual sub-axis is a
    CHECK failure)."""
    if not (isinstance(x, _ArrayImpl) and x.committed):
        return False
    sharding = x.sharding
    if sharding.device_set != set(mesh.devices.flat):
        return True
    if isinstance(sharding, NamedSharding) and sharding.mesh != mesh:
        return True
    typed_on = jax.typeof(x).sharding.mesh
    return not typed_on.empty and typed_on != mesh.abstract_mesh


class InputsOnAnotherMesh(NxopsError):
    """An input typed on another mesh than the xmap's. Raised while tracing;
    a call with concrete arrays moves them onto the mesh and runs again, so
    users see it only for traced inputs (inside jax.jit, jax.grad, ...)."""


def refuse_inputs_on_another_mesh(args: tuple, plan: Plan, flat_specs: list) -> None:
    """Raises InputsOnAnotherMesh for an input typed on a mesh other than
    the one in scope: JAX refuses to mix them in one program (a raw
    ValueError or KeyError), or XLA aborts the process compiling it. A nested
    xmap's inputs are the enclosing body's values (on its manual mesh)."""
    mesh = mesh_in_scope()
    if mesh is None or _mesh_lib.get_abstract_mesh().manual_axes:
        return   # (with no mesh JAX runs an input typed on one as it is)
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(args)[0], flat_specs):
        typed_on = jax.typeof(x).sharding.mesh
        if typed_on.empty or typed_on == mesh.abstract_mesh:
            continue
        pspec = plan.partition_spec(spec, x.ndim) if plan.mesh is not None else PartitionSpec()
        raise InputsOnAnotherMesh(
            f"xmap argument args{jax.tree_util.keystr(path)} lives on another mesh, "
            f"{_show_mesh(typed_on)}, but this xmap runs under mesh {_show_mesh(mesh)}. "
            f"One program cannot hold both meshes (JAX refuses it, and XLA may abort the "
            f"process). nxops moves concrete arrays itself; a traced one (inside jax.jit, "
            f"jax.grad, jax.vmap, ...) cannot be moved there. Move it before the transformation: "
            f"x = jax.device_put(x, jax.NamedSharding(mesh, {pspec})), or make it under the "
            f"mesh the xmap runs on.")


def replicated_off_mesh(args: tuple) -> tuple:
    """With no mesh in scope, inputs typed as split over a mesh (made under
    ``jax.set_mesh`` on Explicit axes) retyped replicated on it: the body's
    ``jax.vmap`` refuses to map inputs whose types split them differently
    ("Mapped away dimension of inputs passed to vmap should be sharded the
    same"). Under a mesh, ``refuse_inputs_on_another_mesh`` decides."""
    if mesh_in_scope() is not None or _mesh_lib.get_abstract_mesh().manual_axes:
        return args

    def replicated(x):
        sharding = jax.typeof(x).sharding
        if sharding.mesh.empty or all(entry is None for entry in sharding.spec):
            return x
        with jax.sharding.use_abstract_mesh(sharding.mesh):
            return jax.sharding.reshard(x, PartitionSpec(*[None] * x.ndim))
    return jax.tree.map(replicated, args)


def _show_mesh(mesh) -> str:
    """``{'x': 2, 'y': 4} (Explicit, Explicit)``: a mesh's axes, sizes and types."""
    types = ", ".join(str(t).rsplit(".", 1)[-1] for t in getattr(mesh, "axis_types", ()))
    return f"{dict(zip(mesh.axis_names, mesh.axis_sizes))} ({types})"


def place_on_mesh(definition: Definition, args: tuple) -> tuple:
    """``device_put`` committed inputs that live elsewhere than the mesh
    (other devices, or another mesh: see ``_elsewhere``): per the plan, or
    replicated when the plan maps nothing to the mesh. ``args`` itself
    when none does."""
    leaves, tree = jax.tree.flatten(args)
    committed = [isinstance(x, _ArrayImpl) and x.committed for x in leaves]
    targets = definition.shardings(args) if any(committed) else None
    if targets is None:
        return args
    shardings, _ = targets
    moved = [_elsewhere(x, sharding.mesh) for x, sharding in zip(leaves, shardings)]
    if not any(moved):
        return args
    leaves = [jax.device_put(_untyped_by_stale_mesh(x), sharding) if m else x
              for x, sharding, m in zip(leaves, shardings, moved)]
    return jax.tree.unflatten(tree, leaves)

def typed_per_plan(definition: Definition, args: tuple) -> tuple:
    """For ``lower``: the inputs that carry no sharding of their own
    (NumPy arrays, scalars, uncommitted arrays, bare ShapeDtypeStructs), as
    ShapeDtypeStructs sharded per the plan on the mesh, so the compiled
    program's ``input_shardings`` are NamedShardings with the plan's specs,
    as ``jax.jit(..., in_shardings=...)`` gives (not bare GSPMDShardings)."""
    targets = definition.shardings(args)
    if targets is None or not targets[1]:   # no mesh, or the plan uses no mesh axis
        return args
    leaves, tree = jax.tree.flatten(args)

    def typed(x, sharding):
        placed = x.committed if isinstance(x, _ArrayImpl) else getattr(x, "sharding", None)
        if placed:
            return x
        aval = jax.typeof(x)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding,
                                    weak_type=aval.weak_type)
    return jax.tree.unflatten(tree, [typed(x, s) for x, s in zip(leaves, targets[0])])
