"""The positional program of one xmap plan, built from public JAX transformations:

    jax.shard_map(mesh axes) ∘ [lax.scan per serial loop] ∘ jax.vmap(tile) per name ∘ body

Each named dimension of a local array is first split into sub-dimensions
``(loop lengths..., tile)``; every level (a loop or a tile) then consumes its
sub-dimension. Dimensions are tracked by tags: ``PosTag(d)``, ``LoopTag(loop)``
and ``TileTag(name)``, and an output's *full layout* is the list of tags of its
split form. Every level returns outputs whose layout is the full layout
restricted to the tags not yet consumed by enclosing levels.

A named axis gets a vmap level, so vmap's own batching tells which outputs
vary along it, unless mesh axes alone carry it (``AxisPlan.vmapped``): its
size-1 tile dimension is then squeezed away (a size-1 vmap costs transposes
and copies in the compiled program), and a walk of the program's jaxpr
(``_custom_rules.walk_program``) tells which outputs vary along it.

The user's body is traced once per lowering: the program over mesh axes is
traced to a jaxpr that is walked and then evaluated, and a serial loop's step
is traced to a jaxpr that its scan evaluates.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from nxops._jax import eval_closed_jaxpr, stage_to_evaluate
from nxops._jax import infer_out_axes as _infer_out_axes
from nxops._jax import spmd_axis_names, type_constants_in_current_trace
from nxops._errors import NxopsError
from nxops.kernels.xla.collectives import CPU_UNSAFE_DTYPES
from nxops.ops._axis_env import (InternalAxisName, TileAxisName, collect_custom_calls,
                                      loop_step, varies_hint)
from nxops.ops._axis_env import mesh_platform as _mesh_platform
from nxops.xmap._custom_rules import walk_program
from nxops.xmap._plan import Plan, check_shared_resources
from nxops.xmap._raw_lax import raw_lax_error
from nxops.xmap._specs import AxisSpec, broadcast_specs, check_output_rank



@dataclasses.dataclass(frozen=True)
class PosTag:
    """A positional dimension ``dim`` of the argument or result."""

    dim: int


@dataclasses.dataclass(frozen=True)
class LoopTag:
    """The sub-dimension of a named dimension that the serial ``loop`` consumes."""

    loop: Any


@dataclasses.dataclass(frozen=True)
class TileTag:
    """The sub-dimension of the named dimension ``name`` that its vmap level consumes."""

    name: str


Tag = PosTag | LoopTag | TileTag
Inner = Callable[[list, list], tuple[list, list]]


@dataclasses.dataclass
class _Outputs:
    """What the body returned, learned while tracing it (the same in every level)."""

    tree: Any = None
    specs: list = dataclasses.field(default_factory=list)
    paths: list = dataclasses.field(default_factory=list)
    layouts: list = dataclasses.field(default_factory=list)


def split_layout(spec: AxisSpec, ndim: int, plan: Plan) -> list[Tag]:
    """The tags of an array of rank ``ndim`` once its named dims are split."""
    named = spec.mapping
    tags: list[Tag] = []
    for dim in range(ndim):
        if dim in named:
            axis = plan.axis(named[dim])
            tags += [LoopTag(loop) for loop in axis.loops] + [TileTag(axis.name)]
        else:
            tags.append(PosTag(dim))
    return tags


def _split_shape(spec: AxisSpec, local_shape: Sequence[int], plan: Plan) -> list[int]:
    named = spec.mapping
    shape: list[int] = []
    for dim, size in enumerate(local_shape):
        if dim in named:
            axis = plan.axis(named[dim])
            shape += [loop.length for loop in axis.loops] + [axis.tile]
        else:
            shape.append(size)
    return shape


def _merge_split_dims(x, spec: AxisSpec, ndim: int, plan: Plan):
    named = spec.mapping
    shape, i = [], 0
    for dim in range(ndim):
        parts = len(plan.axis(named[dim]).loops) + 1 if dim in named else 1
        shape.append(math.prod(x.shape[i:i + parts]))
        i += parts
    return _reshaped(x, shape)


def _reshaped(x, shape: Sequence[int]):
    """``x.reshape(shape)``, with no operation when it already has that shape."""
    return x if tuple(x.shape) == tuple(shape) else lax.reshape(x, tuple(shape))


def _restrict(full: list[Tag], present: list[Tag], tag: Tag) -> list[Tag]:
    return [t for t in full if t == tag or t in present]


def _varies_error(outputs: _Outputs, j: int, name: str) -> NxopsError:
    spec = outputs.specs[j]
    return NxopsError(
        f"One of xmap results (out{outputs.paths[j]}) has an out_axes specification of "
        f"{spec.user_repr}, but it varies along the named axis {name!r}, which that "
        f"specification omits. Add {name!r} to its out_axes, or reduce over it in the "
        f"body (e.g. nx.sum(x, {name!r}) or nx.psum(x, {name!r})). {varies_hint(name)}".rstrip())


def _level_name(vmap_name, plan: Plan):
    """The vmap level's axis name, carrying the plan's logical names."""
    if isinstance(vmap_name, InternalAxisName):
        return vmap_name.with_logical(plan.logical_axes())
    return TileAxisName(vmap_name, plan.logical_axes())


def _tile_level(plan: Plan, name: str, inner: Inner, outputs: _Outputs) -> Inner:
    axis = plan.axis(name)
    tag = TileTag(name)

    def level(flat: list, layouts: list) -> tuple[list, list]:
        in_axes = tuple(lay.index(tag) if tag in lay else None for lay in layouts)
        inner_layouts: list = []

        def vmapped(*xs):
            outs, lays = inner(list(xs), [[t for t in lay if t != tag] for lay in layouts])
            inner_layouts[:] = lays
            return outs

        outs, src_axes = jax.vmap(vmapped, in_axes=in_axes, out_axes=_infer_out_axes,
                                  axis_name=_level_name(axis.vmap_name, plan),
                                  axis_size=axis.tile)(*flat)
        new_outs, new_layouts = [], []
        for j, (x, src, lay) in enumerate(zip(outs, src_axes, inner_layouts)):
            if tag not in outputs.layouts[j]:
                if src is not None:
                    raise _varies_error(outputs, j, name)
                new_outs.append(x)
                new_layouts.append(lay)
                continue
            target = _restrict(outputs.layouts[j], lay, tag)
            dst = target.index(tag)
            if src is None:   # does not vary along the name: broadcast
                x = jnp.expand_dims(x, dst)
                x = jnp.broadcast_to(x, x.shape[:dst] + (axis.tile,) + x.shape[dst + 1:])
            else:
                x = jnp.moveaxis(x, src, dst)
            new_outs.append(x)
            new_layouts.append(target)
        return new_outs, new_layouts
    return level


def _squeeze_level(name: str, inner: Inner, outputs: _Outputs) -> Inner:
    """A name carried by mesh axes alone: its size-1 tile dimension is dropped
    from the inputs and put back into the results (reshapes, no vmap). Whether
    a result varies along the name is learned from the program's jaxpr
    (``check_unvmapped_varying``)."""
    tag = TileTag(name)

    def level(flat: list, layouts: list) -> tuple[list, list]:
        flat = [lax.squeeze(x, (lay.index(tag),)) if tag in lay else x
                for x, lay in zip(flat, layouts)]
        outs, inner_layouts = inner(flat, [[t for t in lay if t != tag] for lay in layouts])
        new_outs, new_layouts = [], []
        for j, (x, lay) in enumerate(zip(outs, inner_layouts)):
            if tag not in outputs.layouts[j]:
                new_outs.append(x)
                new_layouts.append(lay)
                continue
            target = _restrict(outputs.layouts[j], lay, tag)
            new_outs.append(lax.expand_dims(x, (target.index(tag),)))
            new_layouts.append(target)
        return new_outs, new_layouts
    return level


def check_unvmapped_varying(plan: Plan, outputs: _Outputs, varies_along) -> None:
    """Raises for a result that varies along a name without a vmap level
    which its out_axes omit. ``varies_along(j, axis)``: whether result ``j``
    varies along the plan's ``axis``."""
    for axis in reversed(plan.axes):   # the innermost level first, as vmap levels raise
        if axis.vmapped:
            continue
        for j, layout in enumerate(outputs.layouts):
            if TileTag(axis.name) not in layout and varies_along(j, axis):
                raise _varies_error(outputs, j, axis.name)


def _zeros_like_aval(aval):
    zeros = jnp.zeros(aval.shape, aval.dtype)
    varying = tuple(getattr(aval.manual_axis_type, "varying", ()) or ())
    return lax.pcast(zeros, varying, to="varying") if varying else zeros


# The closed-over arrays that the traces of the program being traced typed on
# the body's mesh (``retyped_constants``); None outside it.
_RETYPED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "nxops_retyped_constants", default=None)


@contextlib.contextmanager
def retyped_constants() -> Any:
    """Collects, while a program is traced, the closed-over arrays its traces
    typed on the body's mesh (named by xmap's error if JAX still refuses them)."""
    retyped: list = []
    token = _RETYPED.set(retyped)
    try:
        yield retyped
    finally:
        _RETYPED.reset(token)


def _retype_closed_over_arrays() -> None:
    """In the trace being made (a shard_map body, a loop step, or the staging
    of either), closed-over arrays typed on a mesh with Explicit axes are
    typed replicated on the body's mesh as they are met: the two do not mix
    there (see ``_jax.type_constants_in_current_trace``), and inside the
    shard_map every device holds the whole constant anyway."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes:
        type_constants_in_current_trace(functools.partial(_replicated_on, mesh))


def _replicated_on(mesh, constant):
    """The type of ``constant`` replicated on ``mesh`` if it is a concrete
    array typed on another mesh with Explicit axes, else None (its own)."""
    if not on_explicit_mesh(constant):
        return None
    aval = jax.typeof(constant)
    if aval.sharding.mesh == mesh:
        return None
    retyped = _RETYPED.get()
    if retyped is not None and all(r is not constant for r in retyped):
        retyped.append(constant)
    return aval.update(sharding=NamedSharding(mesh, PartitionSpec()))


def on_explicit_mesh(constant) -> bool:
    """Whether ``constant`` is a concrete array typed on a mesh with Explicit axes."""
    sharding = getattr(constant, "sharding", None) if isinstance(constant, jax.Array) else None
    return (not isinstance(constant, jax.core.Tracer) and isinstance(sharding, NamedSharding)
            and AxisType.Explicit in tuple(getattr(sharding.mesh, "axis_types", ())))


def _loop_level(loop, inner: Inner, outputs: _Outputs) -> Inner:
    tag = LoopTag(loop)

    def level(flat: list, layouts: list) -> tuple[list, list]:
        scanned = [i for i, lay in enumerate(layouts) if tag in lay]
        xs = [jnp.moveaxis(flat[i], layouts[i].index(tag), 0) for i in scanned]
        sub_layouts = [[t for t in lay if t != tag] for lay in layouts]
        inner_layouts: list = []

        def one_step(index, xs_step):
            _retype_closed_over_arrays()
            args = list(flat)
            for i, x in zip(scanned, xs_step):
                args[i] = x
            with loop_step(loop, index):   # position queries see the global position
                outs, lays = inner(args, sub_layouts)
            inner_layouts[:] = lays
            return outs

        # Outputs along the loop's names are stacked (scan's ys); the others do
        # not vary along them and are carried (their shapes come from one step).
        # The step is traced once, to a jaxpr that scan's step evaluates: the
        # body is not called again.
        steps = jnp.arange(loop.length, dtype=jnp.int32)
        step_jaxpr = stage_to_evaluate(one_step, steps[0], [x[0] for x in xs])
        step_avals = step_jaxpr.out_avals
        stacked = [tag in outputs.layouts[j] for j in range(len(step_avals))]

        def step(carry, index_and_xs):
            _retype_closed_over_arrays()
            index, xs_step = index_and_xs
            outs = eval_closed_jaxpr(step_jaxpr, index, *xs_step)
            return ([o for o, s in zip(outs, stacked) if not s],
                    [o for o, s in zip(outs, stacked) if s])

        init = [_zeros_like_aval(a) for a, s in zip(step_avals, stacked) if not s]
        carried, ys = lax.scan(_rematerialized(step, loop.remat), init, (steps, xs),
                               length=loop.length)
        carried, ys = iter(carried), iter(ys)
        new_outs, new_layouts = [], []
        for j, (s, lay) in enumerate(zip(stacked, inner_layouts)):
            if not s:
                new_outs.append(next(carried))
                new_layouts.append(lay)
                continue
            target = _restrict(outputs.layouts[j], lay, tag)
            new_outs.append(jnp.moveaxis(next(ys), 0, target.index(tag)))
            new_layouts.append(target)
        return new_outs, new_layouts
    return level


def _rematerialized(step: Callable, remat: Any) -> Callable:
    """The scan step, recomputed in the backward pass unless ``remat`` is False:
    the scan then saves only each step's inputs, not its residuals, so under
    differentiation a loop saves memory as it does forward. Without
    differentiation ``jax.checkpoint`` changes nothing."""
    if remat is False:
        return step
    policy = None if remat is True else remat
    # prevent_cse=False: inside scan CSE cannot hoist the recomputation out of
    # the backward loop, and the barriers would cost (the jax.checkpoint docs).
    return jax.checkpoint(step, prevent_cse=False, policy=policy)


def _body_level(body: Callable, in_tree, plan: Plan, out_axes: Any, user_out_axes: Any,
                outputs: _Outputs) -> Inner:
    def level(flat: list, layouts: list) -> tuple[list, list]:
        try:
            result = body(*jax.tree.unflatten(in_tree, flat))
        except NameError as e:   # a raw jax.lax/jnp call on an xmap name
            error = raw_lax_error(e)
            if error is None:
                raise
            raise error from e
        except ValueError as e:
            if not _is_set_mesh_refusal(e):
                raise
            raise _set_mesh_in_body_error(plan) from e
        path_leaves, tree = jax.tree_util.tree_flatten_with_path(result)
        leaves = [jnp.asarray(x) for _, x in path_leaves]
        specs = broadcast_specs(out_axes, result, "out_axes", user_out_axes)
        paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
        for spec, x, path in zip(specs, leaves, paths):
            check_output_rank(spec, x.shape, f"out{path}")
            check_shared_resources(plan, spec, f"result out{path}")
        outputs.tree, outputs.specs, outputs.paths = tree, specs, paths
        outputs.layouts = [split_layout(s, x.ndim + len(s.names), plan)
                           for s, x in zip(specs, leaves)]
        return leaves, [[t for t in lay if isinstance(t, PosTag)] for lay in outputs.layouts]
    return level


def _is_set_mesh_refusal(error: ValueError) -> bool:
    """JAX's refusal of ``jax.set_mesh`` under a trace (the body is traced in jit)."""
    return not isinstance(error, NxopsError) and "`set_mesh` can only be used outside" in str(error)


def _set_mesh_in_body_error(plan: Plan) -> NxopsError:
    where = (f"this call maps names to mesh axes {plan.mesh_axes}" if plan.mesh is not None
             else "this call maps no name to a mesh axis")
    return NxopsError(
        f"jax.set_mesh inside the xmapped function: the body is traced inside jax.jit, where "
        f"JAX refuses to change the mesh, and an xmap's mesh is the one in scope where it is "
        f"called ({where}). Call the xmap under `with jax.set_mesh(mesh):` instead, and map "
        f"names to the mesh's axes with axis_resources (a nested xmap may map its own names "
        f"to axes the outer one leaves free).")


def _reshard(x, plan: Plan, spec: AxisSpec):
    """Moves an input to the plan's sharding inside jit (a no-op when it is)."""
    sharding = NamedSharding(plan.mesh, plan.partition_spec(spec, x.ndim))
    types = {plan.mesh._name_to_type[a] for a in plan.mesh_axes}
    if AxisType.Explicit in types:
        if jax.typeof(x).sharding.mesh.empty:   # made before set_mesh
            return _reshard_from_no_mesh(x, sharding, NamedSharding(plan.mesh, PartitionSpec()))
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _retype(x, plan: Plan, spec: AxisSpec):
    """``_reshard`` for a shard_map manual over every axis of the mesh: its
    in_specs alone then place an input on Auto axes (a sharding constraint
    would say the same again); on Explicit axes the input's type still moves."""
    types = {plan.mesh._name_to_type[a] for a in plan.mesh_axes}
    return _reshard(x, plan, spec) if AxisType.Explicit in types else x


def _covers_mesh(axis_names: frozenset, mesh) -> bool:
    """Whether a shard_map manual over ``axis_names`` leaves no axis of
    ``mesh`` to the partitioner: its in_specs and out_specs then fix where
    every operand and result lives."""
    return all(a in axis_names for a in mesh.axis_names)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _reshard_from_no_mesh(x, sharding: NamedSharding, replicated: NamedSharding):
    """``reshard(x, sharding)`` for an input typed on no mesh, whose tangent
    goes through the replicated type: the cotangent then comes back typed
    replicated, not sharded on a mesh the input's type lacks (jax.jacrev fails
    on that). The value itself moves straight to ``sharding``."""
    return jax.sharding.reshard(x, sharding)


@_reshard_from_no_mesh.defjvp
def _reshard_from_no_mesh_jvp(sharding, replicated, primals, tangents):
    (x,), (t,) = primals, tangents
    return (jax.sharding.reshard(x, sharding),
            jax.sharding.reshard(jax.sharding.reshard(t, replicated), sharding))


def _reshard_inside_manual_region(x, plan: Plan, spec: AxisSpec):
    """An input of a nested xmap, moved to its sharding over the axes the
    enclosing region left Explicit (JAX 0.12's shard_map checks it matches)."""
    mesh = jax.sharding.get_abstract_mesh()
    if all(mesh._name_to_type[a] != AxisType.Explicit for a in plan.mesh_axes):
        return x
    return jax.sharding.reshard(x, plan.partition_spec(spec, x.ndim))


def build_program(body: Callable, plan: Plan, in_tree, in_specs: list[AxisSpec],
                  out_axes: Any, user_out_axes: Any,
                  variance: list | None = None) -> tuple[Callable, _Outputs]:
    """``program(*flat_args) -> flat results``; the returned ``_Outputs`` is filled
    in when the program is traced (its ``tree`` unflattens the results).
    ``variance``: the logical names each result varies along, when a plan
    whose names share a resource was analysed (``_varying.analyse_shared``);
    otherwise the walk of the program's jaxpr tells (in mesh axes)."""
    outputs = _Outputs()
    inner: Inner = _body_level(body, in_tree, plan, out_axes, user_out_axes, outputs)
    for axis in reversed(plan.axes):
        if axis.vmapped:
            inner = _tile_level(plan, axis.name, inner, outputs)
        else:
            inner = _squeeze_level(axis.name, inner, outputs)
    for loop in reversed(plan.loops):
        inner = _loop_level(loop, inner, outputs)

    def local_program(*flat):
        split = [_reshaped(x, _split_shape(s, x.shape, plan)) for x, s in zip(flat, in_specs)]
        layouts = [split_layout(s, x.ndim, plan) for x, s in zip(flat, in_specs)]
        outs, _ = inner(split, layouts)
        return [_merge_split_dims(x, s, x.ndim - sum(len(plan.axis(n).loops) for n in s.axis_names), plan)
                for x, s in zip(outs, outputs.specs)]

    if plan.mesh is None:
        return local_program, outputs
    return _OverMesh(local_program, plan, in_specs, outputs, variance), outputs


def _local_shape(shape: Sequence[int], pspec, mesh) -> tuple[int, ...]:
    """The per-device shape of a global ``shape`` split by ``pspec`` over ``mesh``."""
    entries = tuple(pspec) + (None,) * (len(shape) - len(pspec))
    sizes = []
    for size, entry in zip(shape, entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        sizes.append(size // math.prod(mesh.shape[a] for a in axes))
    return tuple(sizes)


@dataclasses.dataclass
class _MeshCall:
    """One call of the program over the mesh: its inputs as the shard_map
    takes them, and what tracing the body learns about its results."""

    flat: list             # the program's inputs
    specs: list            # their AxisSpecs
    empty: list            # per input: its local shape if zero-size (made inside), else None
    passed: list           # the inputs the shard_map takes (the others are zero-size)
    in_pspecs: tuple       # their PartitionSpecs
    narrowed: list         # per passed input: its 16-bit dtype if it enters as f32, else None
    axis_names: frozenset  # the shard_map's manual mesh axes
    # Set while the body is traced. shard_map reads out_specs once the body
    # returns: the specs of the results that hold data. Zero-size results are
    # made outside the shard_map (sharded over mesh axes one cannot be read:
    # PJRT hands back each shard with the global shape); per result, None or
    # the ShapeDtypeStruct of the global zero-size value.
    out_specs: list = dataclasses.field(default_factory=list)
    empty_results: list = dataclasses.field(default_factory=list)


class _OverMesh:
    """``local_program`` run under ``jax.shard_map`` over the plan's mesh axes
    (inputs moved to the plan's sharding first, unless already inside a manual
    region)."""

    def __init__(self, local_program: Callable, plan: Plan, in_specs: list[AxisSpec],
                 outputs: _Outputs, variance: list | None):
        self._local_program, self._plan, self._in_specs = local_program, plan, in_specs
        self._outputs, self._variance = outputs, variance

    def __call__(self, *flat) -> list:
        manual = jax.sharding.get_abstract_mesh().manual_axes
        call = self._prepare(list(flat), manual)
        abstract = jax.sharding.get_abstract_mesh()
        mesh = abstract if not abstract.empty else self._plan.mesh
        # check_vma=False: the vmap levels and the walk of the body's jaxpr
        # already check, per logical name, that no result varies along a name
        # its out_axes omit. It also keeps jax.grad inside the body per
        # position for replicated inputs (per-example gradients), as under vmap
        # and loops; check_vma=True would sum those over devices, and JAX has no
        # varying -> invariant cast to undo it for free.
        outs = iter(jax.shard_map(functools.partial(self._sharded, call), mesh=mesh,
                                  in_specs=call.in_pspecs, out_specs=call.out_specs,
                                  axis_names=call.axis_names, check_vma=False)(*call.passed))
        results = [next(outs) if e is None else jnp.zeros(e.shape, e.dtype)
                   for e in call.empty_results]
        if manual or spmd_axis_names() or _covers_mesh(call.axis_names, mesh):
            return results
        return [constrain_on_auto_mesh(x, self._plan, s)
                for x, s in zip(results, self._outputs.specs)]

    def _prepare(self, flat: list, manual) -> _MeshCall:
        plan, specs = self._plan, self._in_specs
        # Zero-size inputs hold no data: they are made inside the body instead of
        # passed in (Shardy rejects a manual computation whose operands are all
        # zero-size: "expected at least one operand ... GlobalToLocalShape").
        empty = [_local_shape(x.shape, plan.partition_spec(s, x.ndim), plan.mesh)
                 if x.size == 0 else None for x, s in zip(flat, specs)]
        # Under jax.vmap(..., spmd_axis_name=...) the spmd axes are manual too:
        # JAX's batching rule of a shard_map that leaves them automatic fails.
        axis_names = frozenset(plan.mesh_axes) | spmd_axis_names()
        move = (_reshard_inside_manual_region if manual
                else _retype if _covers_mesh(axis_names, plan.mesh) else _reshard)
        passed = [(move(x, plan, s), s) for x, s, e in zip(flat, specs, empty) if e is None]
        in_pspecs = tuple(plan.partition_spec(s, x.ndim) for x, s in passed)
        narrowed = [_narrowed_dtype(x, p, axis_names) for (x, _), p in zip(passed, in_pspecs)]
        passed_arrays = [x if d is None else x.astype(jnp.float32)
                         for (x, _), d in zip(passed, narrowed)]
        return _MeshCall(flat, specs, empty, passed_arrays, in_pspecs, narrowed, axis_names)

    def _sharded(self, call: _MeshCall, *local) -> list:
        """The shard_map's body: the local program on each device's blocks."""
        plan = self._plan
        _retype_closed_over_arrays()
        local = iter([x if d is None else x.astype(d) for x, d in zip(local, call.narrowed)])
        args = [next(local) if e is None else jnp.zeros(e, x.dtype)
                for x, e in zip(call.flat, call.empty)]
        arg_mesh_axes = [() if e is not None else _pspec_axes(plan.partition_spec(s, x.ndim))
                         for x, s, e in zip(call.flat, call.specs, call.empty)]
        results = _run_body(self._local_program, args, plan, arg_mesh_axes, self._outputs,
                            self._variance)
        pspecs = [plan.partition_spec(s, x.ndim) for x, s in zip(results, self._outputs.specs)]
        call.empty_results[:] = [_empty_global(x, p, plan.mesh) for x, p in zip(results, pspecs)]
        call.out_specs[:] = [p for p, e in zip(pspecs, call.empty_results) if e is None]
        return [x for x, e in zip(results, call.empty_results) if e is None]


def constrain_on_auto_mesh(x, plan: Plan, spec: AxisSpec):
    """A top-level result, sharded per the plan over a mesh of Auto axes (the
    legacy ``with mesh:``): the shard_map fixes only the plan's axes (and a
    plan without mesh axes none), and the partitioner would otherwise keep a
    nested xmap's sharding over the other ones. On Explicit axes the
    result's type already says the plan's; off a mesh there is nothing to say."""
    mesh = plan.mesh if plan.mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes or AxisType.Explicit in tuple(mesh.axis_types):
        return x
    pspec = plan.partition_spec(spec, x.ndim) if plan.mesh is not None else PartitionSpec()
    return lax.with_sharding_constraint(x, NamedSharding(mesh, pspec))


class NeedsVmapLevels(Exception):
    """Internal: a cond's branches differ per device around a collective over
    mesh axes of a name without a vmap level; the plan needs vmap levels
    (under which such a cond is batched: every branch runs, a select)."""


def _run_body(local_program: Callable, args: list, plan: Plan, in_mesh_axes: list,
              outputs: _Outputs, variance: list | None) -> list:
    """``local_program(*args)`` inside the shard_map: traced once to a jaxpr,
    which a walk reads (``_custom_rules.walk_program``), then evaluated.

    The walk tells which mesh axes each result varies along (for names
    without a vmap level), refuses while loops whose trip count differs
    across the devices of a collective, and, when a custom_vjp's primal runs
    a named op over mesh axes, tells each custom_vjp call which mesh axes its
    operands and results vary along, for a jax.grad outside the xmap."""
    def retyping_program(*local):
        _retype_closed_over_arrays()
        return local_program(*local)

    with collect_custom_calls() as calls:
        closed = stage_to_evaluate(retyping_program, *args)
    typed = any(call.kind == "custom_vjp" and call.primal_mesh_op is not None for call in calls)
    out_mesh_axes = [_pspec_axes(plan.partition_spec(s, v.aval.ndim))
                     for v, s in zip(closed.jaxpr.outvars, outputs.specs)] if typed else ()
    mesh_varying, branches_per_device = walk_program(closed.jaxpr, in_mesh_axes, plan, typed,
                                                     out_mesh_axes)
    if branches_per_device and plan.unvmapped():
        raise NeedsVmapLevels()
    if variance is None:
        check_unvmapped_varying(plan, outputs, lambda j, axis: any(
            m in mesh_varying[j] for m in axis.mesh_axes))
    else:
        check_unvmapped_varying(plan, outputs, lambda j, axis: axis.name in variance[j])
    return eval_closed_jaxpr(closed, *args)


def _pspec_axes(pspec) -> tuple:
    """The mesh axes a PartitionSpec splits over."""
    return tuple(a for entry in pspec for a in _entry_axes(entry))


def _narrowed_dtype(x, pspec, axis_names: frozenset):
    """The 16-bit float dtype of an input replicated over some of the shard_map's
    mesh axes on CPU, which then enters the shard_map as f32 (None otherwise).
    shard_map's transpose sums such an input's cotangent over those axes, and
    XLA:CPU aborts the process compiling a bf16/f16 all-reduce over part of a
    mesh (CHECK "Invalid binary instruction opcode copy"; a plain shard_map
    aborts too). The casts are exact and linear: the sum runs in f32."""
    if x.dtype not in CPU_UNSAFE_DTYPES or _mesh_platform() != "cpu":   # (or a PRNG key)
        return None
    used = {a for entry in pspec for a in _entry_axes(entry)}
    return x.dtype if axis_names - used else None


def _entry_axes(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _empty_global(x, pspec, mesh) -> jax.ShapeDtypeStruct | None:
    """The global shape and dtype of a zero-size local result ``x`` (split by
    ``pspec`` over ``mesh``), or None when it holds data (or is of an extended
    dtype such as PRNG keys, which jnp.zeros cannot make)."""
    if x.size != 0 or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return None
    entries = tuple(pspec) + (None,) * (x.ndim - len(pspec))
    shape = []
    for size, entry in zip(x.shape, entries):
        shape.append(size * math.prod(mesh.shape[a] for a in _entry_axes(entry)))
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
