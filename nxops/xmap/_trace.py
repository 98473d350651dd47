"""What an ``nx.xmap``'s jitted program traces for a call: the plan, the
checks of the inputs and the body, then the program the plan builds."""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from nxops._errors import NxopsError
from nxops._jax import spmd_axis_names
from nxops.ops._axis_env import logical_axes, names_used
from nxops.xmap._definition import Definition
from nxops.xmap._enclosing import ENCLOSING_MESH, enclosing_mesh
from nxops.xmap._inputs import refuse_inputs_on_another_mesh, replicated_off_mesh
from nxops.xmap._plan import Plan
from nxops.xmap._program import (NeedsVmapLevels, build_program, constrain_on_auto_mesh,
                                 on_explicit_mesh, retyped_constants)
from nxops.xmap._varying import (analyse_shared, closed_over_constants, runs_without,
                                  shared_resources)
from nxops.xmap._xmap_errors import (closed_over_error, closed_over_tracer_error,
                                     closing_over_explicit, mixing_mesh_types,
                                     nested_closure_error, quote)


def run(definition: Definition, mesh: Mesh | None, resources: dict, args: tuple) -> Any:
    """What the jitted program traces: plan, checks, then the program."""
    nested = ENCLOSING_MESH.get() is not None
    plan, flat_specs = definition.plan(args, mesh, resources)
    refuse_inputs_on_another_mesh(args, plan, flat_specs)
    args = replicated_off_mesh(args)
    with enclosing_mesh():
        variance = analyse_shared(definition.fun, plan, jax.tree.structure(args),
                                  jax.tree.leaves(args), flat_specs)
    program_plan = plan
    if variance is None and shared_resources(plan) and plan.unvmapped():
        program_plan = plan.with_vmap_levels()   # vmap then tells what varies
    with names_used(bool(definition.body_only_names)) as used:
        try:
            results, outputs = _traced_program(definition, program_plan, args, flat_specs,
                                               variance, nested)
        except NeedsVmapLevels:   # rare: the body's one more trace
            results, outputs = _traced_program(definition, program_plan.with_vmap_levels(),
                                               args, flat_specs, variance, nested)
    unseen = [n for n in definition.body_only_names if n not in used]
    if unseen:   # (its named ops did not use them: the body's own check traces it)
        with enclosing_mesh():
            _check_body_uses(definition, plan, args, flat_specs, unseen)
    if nested:
        results = [_unsharded_type(x) for x in results]
    elif plan.mesh is None and not spmd_axis_names():   # (else _program constrains)
        results = [constrain_on_auto_mesh(x, plan, s)
                   for x, s in zip(results, outputs.specs)]
    return jax.tree.unflatten(outputs.tree, results)


def _traced_program(definition: Definition, plan: Plan, args: tuple, flat_specs: list, variance,
                    nested: bool):
    """The plan's program traced on ``args``: (flat results, its _Outputs)."""
    tree, leaves = jax.tree.structure(args), jax.tree.leaves(args)
    program, outputs = build_program(definition.fun, plan, tree, flat_specs, definition.out_axes,
                                     definition.user_out_axes, variance)
    with logical_axes(plan.logical_axes()), enclosing_mesh():
        return _trace(definition.fun, program, plan, tree, leaves, flat_specs, nested), outputs


def _check_body_uses(definition: Definition, plan: Plan, args: tuple, flat_specs: list,
                     names: list) -> None:
    """A name that only ``axis_sizes`` gives and that the body does not use
    either is likely misspelled: it would define a name silently. Asked of
    the ``names`` no named op used while the program was traced (one more
    trace of the body each: a use the named ops do not record, a misspelling)."""
    tree, leaves = jax.tree.structure(args), jax.tree.leaves(args)
    unused = [n for n in names
              if runs_without(definition.fun, plan, [n], tree, leaves, flat_specs)]
    if unused:
        raise NxopsError(
            f"axis_sizes={definition.axis_sizes!r} gives the size of "
            f"{', '.join(map(repr, unused))}, which no in_axes or out_axes names "
            f"(in_axes={quote(definition.user_in_axes)}, "
            f"out_axes={quote(definition.user_out_axes)}) "
            f"and no collective or named op of the body uses. Remove it, or check the "
            f"spelling of the names.")


def _trace(fun, program, plan: Plan, tree, leaves: list, flat_specs: list, nested: bool):
    """``program(*leaves)``, whose traces on a mesh type the arrays the body
    closes over that were made under an Explicit mesh on the body's mesh
    (``_program.retyped_constants``): errors name those JAX still refuses."""
    with retyped_constants() as retyped:
        try:
            return program(*leaves)
        except (NxopsError, NeedsVmapLevels):
            raise
        except Exception as e:
            if plan.mesh is None:
                raise
            # Those met before the failure, or else (when JAX refused one on
            # its way in, e.g. into a jax.numpy function's jit) those a trace
            # of the body on one instance finds: an error path only.
            constants = retyped or [c for c in closed_over_constants(
                fun, plan, tree, leaves, flat_specs) if on_explicit_mesh(c)]
            if constants:
                raise closed_over_error(constants, plan) from e
            if nested and closing_over_explicit(e):
                raise nested_closure_error(plan) from e
            if mixing_mesh_types(e):
                raise closed_over_tracer_error(plan) from e
            raise


def _unsharded_type(x):
    """A nested xmap's result, typed replicated over the mesh axes its type is
    sharded on: the enclosing body sees values, whatever the placement (typed
    sharded over an Explicit axis, even slicing the named dim fails)."""
    spec = jax.typeof(x).sharding.spec
    if all(entry is None for entry in spec):
        return x
    return jax.sharding.reshard(x, PartitionSpec(*[None] * x.ndim))
