"""``nx.xmap``: named-axis programming on top of vmap, shard_map and scan."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nxops._jax import ArrayImpl as _ArrayImpl
from nxops._jax import device_context as _device_context     # what jax.set_mesh sets
from nxops._jax import legacy_mesh_context as _legacy_meshes   # what `with mesh:` sets
from nxops._jax import mesh_lib as _mesh_lib
from nxops._jax import spmd_axis_names
from nxops._jax import staging_into_jaxpr as _staging_into_jaxpr
from nxops._errors import NxopsError
from nxops._traceback import api_boundary
from nxops._platforms import normalize_platform
from nxops._typing import AxisResources
from nxops.ops._axis_env import current_logical_axes, current_logical_axes_map, logical_axes
from nxops.xmap._plan import (Plan, check_shared_resources, mesh_in_scope,
                              normalize_axis_resources, plan_axis_resources)
from nxops.xmap._program import (NeedsVmapLevels, build_program, constrain_on_auto_mesh,
                                 explicit_mesh_constants, pinned_constants)
from nxops.xmap._resources import loops_in_scope
from nxops.xmap._rules import check_rules, current_axis_rules, resources_from_rules
from nxops.xmap._specs import (AxisSpec, broadcast_specs, infer_axis_sizes, parse_spec_tree,
                               spec_names)
from nxops.xmap._varying import (analyse_shared, closed_over_constants, runs_without,
                                  shared_resources)
from nxops.xmap._mesh_calls import MadeOnFirstUse, names_mesh_axes, OffMesh, UnderMesh
from nxops.xmap._xmap_errors import (closed_over_error, closed_over_tracer_error,
                                     closing_over_explicit, explained_value_error,
                                     missing_out_names_error, mixing_mesh_types,
                                     nested_closure_error, non_array_argument_error,
                                     quote)

# The meshes in scope when the enclosing xmap was called (None: no enclosing xmap).
_ENCLOSING_MESH: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "nxops_enclosing_xmap_mesh", default=None)


def _meshes_in_scope() -> tuple:
    """The mesh xmap uses, and the legacy ``with mesh:`` one (to see any change)."""
    return (mesh_in_scope(), _mesh_lib.thread_resources.env.physical_mesh)


@contextlib.contextmanager
def _enclosing_mesh():
    token = _ENCLOSING_MESH.set(_meshes_in_scope())
    try:
        yield
    finally:
        _ENCLOSING_MESH.reset(token)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else tuple(jax.numpy.shape(x))


class XmapFunction:
    """The callable ``nx.xmap`` returns. It keeps one ``jax.jit`` per context
    (mesh, serial loops and enclosing named axes in scope); jit caches the
    plan's program per argument structure, shapes, dtypes and shardings."""

    def __init__(self, fun: Callable, in_axes: Any, out_axes: Any, *,
                 axis_sizes: dict[str, int] | None, axis_resources: dict | None,
                 donate_argnums: int | Sequence[int], backend: str | None):
        if not callable(fun):
            raise NxopsError(f"xmap requires a callable as its first argument, got {fun!r}.")
        self._fun = fun
        self._user_in_axes, self._user_out_axes = in_axes, out_axes
        self._in_axes = parse_spec_tree(in_axes, "in_axes")
        self._out_axes = parse_spec_tree(out_axes, "out_axes")
        self._axis_sizes = dict(axis_sizes or {})
        for name, size in self._axis_sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise NxopsError(f"axis_sizes[{name!r}] = {size!r}: sizes are positive ints.")
        in_names = spec_names(self._in_axes)
        defined = list(dict.fromkeys(in_names + list(self._axis_sizes)))
        out_names = spec_names(self._out_axes)
        missing = [n for n in out_names if n not in defined]
        if missing:
            raise missing_out_names_error(missing, defined, in_axes, out_axes)
        # Names only the body may use (old xmap: `lax.psum(x, 'i')` with
        # axis_sizes={'i': 4}); checked once the body is traced (_check_body_uses).
        self._body_only_names = [n for n in self._axis_sizes if n not in in_names + out_names]
        self._names = defined
        # A rule table resolves now; no axis_resources at all follows the
        # nx.axis_rules(...) in scope at each call (part of the context key).
        self._follows_rule_context = axis_resources is None
        if isinstance(axis_resources, (list, tuple)):
            axis_resources = resources_from_rules(defined, check_rules(axis_resources))
        self._resources = normalize_axis_resources(axis_resources, defined)
        self._donate_argnums = ((donate_argnums,) if isinstance(donate_argnums, int)
                                else tuple(donate_argnums))
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0
               for i in self._donate_argnums):
            raise NxopsError(f"donate_argnums={donate_argnums!r}: give argument positions "
                             f"as ints >= 0.")
        self._backend = _checked_backend(backend)
        self._by_context: dict[tuple, Any] = _shared_jits(fun, (
            _hashable_tree(self._in_axes), _hashable_tree(self._out_axes),
            tuple(sorted(self._axis_sizes.items())), tuple(sorted(self._resources.items())),
            self._donate_argnums, backend))
        # (context probe, its jitted program, the program to trace inline) of
        # the last call; () matches no probe.
        self._last_context: tuple = ((), None, None)
        functools.update_wrapper(self, fun, updated=())   # not __dict__: fun may be an xmap

    def __repr__(self) -> str:
        return (f"nx.xmap({getattr(self._fun, '__name__', self._fun)}, "
                f"in_axes={self._user_in_axes!r}, out_axes={self._user_out_axes!r})")

    @api_boundary
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise NxopsError("xmapped functions take positional arguments only "
                             f"(got keywords {sorted(kwargs)}).")
        # The fast path: the same context objects as the last call (a tuple
        # compare checks identity first) reuse its jitted program.
        probe = (_device_context.value, _legacy_meshes.value,   # _context_probe,
                 loops_in_scope(), current_logical_axes_map(), current_axis_rules())  # inlined
        last_probe, jitted, traced = self._last_context
        if probe != last_probe:
            jitted, traced = self._jitted_for(probe)
        if _staging_into_jaxpr():
            return self._call_traced(traced, args)
        try:
            return jitted(*args)
        except _InputsOnAnotherMesh as e:
            # Arrays typed on another mesh: moved here, outside any trace (one
            # program holding both meshes can abort the process in XLA).
            placed = self._place_on_mesh(args)
            if placed is args:   # traced inputs: the user moves them
                raise NxopsError(str(e)) from None
            return jitted(*placed)
        except TypeError as e:
            # jit could not abstract an argument: name it (jit names xmap's inner `run`).
            error = non_array_argument_error(args)
            if error is None:
                raise
            raise error from e
        except ValueError as e:
            # Checked only after a failure, so the common call pays nothing.
            error = explained_value_error(e, args)
            if error is not None:
                raise error from e
            if isinstance(e, NxopsError) or not _committed_elsewhere(args):
                raise
        # Inputs committed to devices other than the mesh's: move them, then retry.
        return jitted(*self._place_on_mesh(args))

    def _call_traced(self, traced: Callable, args: tuple) -> Any:
        """The program traced inline into the enclosing trace (a jax.jit,
        jax.grad, ...), with no jit of its own: a nested jit would be traced,
        then linearized and lowered as a second function, and the enclosing
        transformation caches the whole trace anyway."""
        error = non_array_argument_error(args)
        if error is not None:
            raise error
        try:
            return traced(*jax.tree.map(_as_array, args))
        except _InputsOnAnotherMesh as e:
            raise NxopsError(str(e)) from None

    @api_boundary
    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Lowers for these arguments (``.compile()``, ``.as_text()``, ...).

        Examples:
            >>> f = nx.xmap(lambda v: nx.sum(v, 'i'), [['i', ...]], [...])
            >>> compiled = f.lower(jnp.ones((4, 3))).compile()
            >>> print(compiled(jnp.ones((4, 3))))
            [4. 4. 4.]
        """
        try:
            return self._jitted()[0].lower(*self._typed_per_plan(self._place_on_mesh(args)))
        except _InputsOnAnotherMesh as e:
            raise NxopsError(str(e)) from None
        except TypeError as e:
            error = non_array_argument_error(args)
            if error is None:
                raise
            raise error from e

    @api_boundary
    def in_shardings(self, *args: Any) -> tuple:
        """Where each argument belongs under the plan, on the mesh in scope.

        Returns a pytree like ``args`` of full-rank ``NamedSharding``s (the
        plan's ``PartitionSpec`` per argument, replicated where the plan maps
        nothing to the mesh). ``jax.device_put(args, f.in_shardings(*args))``
        places parameters and optimizer state once: a jitted training step
        then returns the updated ones with the same shardings, so no step
        recompiles (docs/training.md).

        Examples:
            >>> f = nx.xmap(lambda w, b: w * b, [['a', ...], [...]], ['a', ...],
            ...             axis_resources={'a': 'x'})
            >>> with jax.set_mesh(jax.make_mesh((1,), ('x',))):
            ...     w_at, b_at = f.in_shardings(jnp.ones((4, 3)), jnp.ones(3))
            >>> w_at.spec == jax.sharding.PartitionSpec('x', None)    # full rank
            True
            >>> b_at.spec == jax.sharding.PartitionSpec(None)          # replicated
            True
        """
        targets = self._shardings_per_plan(args)
        if targets is None:
            raise NxopsError(
                f"{self!r}.in_shardings(...) needs the mesh the program runs on: call it "
                f"under jax.set_mesh(mesh) (or `with mesh:`), outside any xmap or shard_map "
                f"body. Without a mesh the program runs on one device and any placement works.")
        leaves, tree = jax.tree.flatten(args)
        return jax.tree.unflatten(tree, [_full_rank(s, len(_shape(x)))
                                         for s, x in zip(targets[0], leaves)])

    # -- the jitted program, one per context --------------------------------

    def _jitted(self):
        return self._jitted_for(_context_probe())

    def _jitted_for(self, probe: tuple):
        # jax.jit caches traces and executables per argument shapes, dtypes and
        # shardings, and the plan is made while tracing: a repeated call costs
        # a jit call plus this lookup (no re-parsing, no re-planning).
        # Equal probes give equal keys, so the probe may stand for the key.
        _, _, loops, names, rules = probe
        rules = rules if self._follows_rule_context else None
        # Whether jax.set_mesh is unset (the legacy `with mesh:` alone) is part
        # of the key: the program is then wrapped to call it under the mesh.
        key = (mesh_in_scope(), _concrete_mesh_unset(), loops, tuple(names.items()), rules)
        programs = self._by_context.get(key)
        if programs is None:
            programs = self._by_context[key] = self._make_jitted(key[0], self._resources_for(rules))
        self._last_context = (probe, *programs)
        return programs

    def _resources_for(self, rules) -> dict:
        if not rules:
            return self._resources
        return normalize_axis_resources(resources_from_rules(self._names, rules), self._names)

    def _make_jitted(self, mesh: Mesh | None, resources: dict) -> tuple[Callable, Callable]:
        """(the jitted program for a call outside any trace, the function it
        jits, for a call inside one)."""
        def run(*args):
            return self._run(mesh, resources, args)

        run.__name__ = getattr(self._fun, "__name__", "xmapped")
        jit_kwargs = {"backend": _present(self._backend)} if self._backend is not None else {}
        concrete_mesh_unset = _concrete_mesh_unset()

        def make() -> Callable:
            jitted = jax.jit(run, donate_argnums=self._donate_argnums, **jit_kwargs)
            on_mesh = jitted if mesh is None or not concrete_mesh_unset else UnderMesh(mesh, jitted)
            if mesh is None or names_mesh_axes(resources, mesh) or jax.process_count() > 1:
                return on_mesh
            return OffMesh(mesh, jitted, on_mesh)
        return MadeOnFirstUse(make), run

    def _run(self, mesh: Mesh | None, resources: dict, args: tuple) -> Any:
        """What the jitted program traces: plan, checks, then the program."""
        nested = _ENCLOSING_MESH.get() is not None
        plan, flat_specs = self._plan(args, mesh, resources)
        _refuse_inputs_on_another_mesh(args, plan, flat_specs)
        args = _replicated_off_mesh(args)
        if self._body_only_names:
            with _enclosing_mesh():
                self._check_body_uses(plan, args, flat_specs)
        with _enclosing_mesh():
            variance = analyse_shared(self._fun, plan, jax.tree.structure(args),
                                      jax.tree.leaves(args), flat_specs)
        if variance is None and shared_resources(plan) and plan.unvmapped():
            plan = plan.with_vmap_levels()   # vmap then tells what varies
        try:
            results, outputs = self._traced_program(plan, args, flat_specs, variance, nested)
        except NeedsVmapLevels:   # rare: the body's one more trace
            results, outputs = self._traced_program(plan.with_vmap_levels(), args,
                                                    flat_specs, variance, nested)
        if nested:
            results = [_unsharded_type(x) for x in results]
        elif plan.mesh is None and not spmd_axis_names():   # (else _program constrains)
            results = [constrain_on_auto_mesh(x, plan, s)
                       for x, s in zip(results, outputs.specs)]
        return jax.tree.unflatten(outputs.tree, results)

    def _traced_program(self, plan: Plan, args: tuple, flat_specs: list, variance, nested: bool):
        """The plan's program traced on ``args``: (flat results, its _Outputs)."""
        tree, leaves = jax.tree.structure(args), jax.tree.leaves(args)
        program, outputs = build_program(self._fun, plan, tree, flat_specs, self._out_axes,
                                         self._user_out_axes, variance)
        with logical_axes(plan.logical_axes()), _enclosing_mesh():
            return self._trace(program, plan, tree, leaves, flat_specs, nested), outputs

    def _check_body_uses(self, plan: Plan, args: tuple, flat_specs: list) -> None:
        """A name that only ``axis_sizes`` gives and that the body does not use
        either is likely misspelled: it would define a name silently."""
        tree, leaves = jax.tree.structure(args), jax.tree.leaves(args)
        unused = [n for n in self._body_only_names
                  if runs_without(self._fun, plan, [n], tree, leaves, flat_specs)]
        if unused:
            raise NxopsError(
                f"axis_sizes={self._axis_sizes!r} gives the size of "
                f"{', '.join(map(repr, unused))}, which no in_axes or out_axes names "
                f"(in_axes={quote(self._user_in_axes)}, out_axes={quote(self._user_out_axes)}) "
                f"and no collective or named op of the body uses. Remove it, or check the "
                f"spelling of the names.")

    def _trace(self, program, plan: Plan, tree, leaves: list, flat_specs: list, nested: bool):
        """``program(*leaves)``; on a mesh, retraced once if the body closes over
        arrays made under an Explicit mesh, which JAX refuses inside the
        shard_map: typed on the body's mesh (see ``_jax.pin_constant``)."""
        try:
            return program(*leaves)
        except (NxopsError, NeedsVmapLevels):
            raise
        except Exception as e:
            if plan.mesh is None:
                raise
            constants = explicit_mesh_constants(
                closed_over_constants(self._fun, plan, tree, leaves, flat_specs))
            if not constants:
                if nested and closing_over_explicit(e):
                    raise nested_closure_error(plan) from e
                if mixing_mesh_types(e):
                    raise closed_over_tracer_error(plan) from e
                raise
        with pinned_constants(constants):
            try:
                return program(*leaves)
            except NxopsError:
                raise
            except Exception as e:
                raise closed_over_error(constants, plan) from e

    def _plan(self, args: tuple, mesh: Mesh | None,
              resources: dict) -> tuple[Plan, list[AxisSpec]]:
        """Checks the arguments against the specs and plans every named axis."""
        beyond = [i for i in self._donate_argnums if i >= len(args)]
        if beyond:
            raise NxopsError(
                f"donate_argnums={self._donate_argnums!r} names argument position(s) "
                f"{', '.join(map(str, beyond))}, but the call passes {len(args)} "
                f"argument(s): donate only positions 0..{len(args) - 1}.")
        enclosing = _ENCLOSING_MESH.get()
        if enclosing is not None and enclosing != _meshes_in_scope():
            raise NxopsError(
                f"Changing the physical mesh is not allowed inside xmap: the enclosing "
                f"xmap was called with mesh {enclosing[0]} in scope, but this call sees "
                f"{_meshes_in_scope()[0]}. Set the mesh once, around the outermost xmap.")
        shadowed = [n for n in self._names if n in current_logical_axes()]
        if shadowed:
            raise NxopsError(
                f"Nested xmaps cannot shadow names of enclosing ones: "
                f"{', '.join(map(repr, shadowed))} already named by an enclosing xmap. "
                f"Rename the inner axes (the inner body may use the outer names).")
        flat_specs = broadcast_specs(self._in_axes, args, "in_axes", self._user_in_axes)
        path_leaves = jax.tree_util.tree_flatten_with_path(args)[0]
        paths = [f"args{jax.tree_util.keystr(p)}" for p, _ in path_leaves]
        shapes = [_shape(x) for _, x in path_leaves]
        sizes = infer_axis_sizes(flat_specs, shapes, paths, self._axis_sizes)
        unknown = [n for n in self._names if n not in sizes]
        if unknown:
            raise NxopsError(
                f"Failed to infer size of axes: {', '.join(map(repr, unknown))}. You've "
                f"probably passed in empty containers in place of arguments that had "
                f"those axes in their in_axes. Provide the sizes of missing axes "
                f"explicitly via axis_sizes to fix this error.")
        plan = plan_axis_resources(sizes, resources, self._names)
        for spec, path in zip(flat_specs, paths):
            check_shared_resources(plan, spec, f"argument {path}")
        return plan, flat_specs

    def _place_on_mesh(self, args: tuple) -> tuple:
        """``device_put`` committed inputs that live elsewhere than the mesh
        (other devices, or another mesh: see ``_elsewhere``): per the plan, or
        replicated when the plan maps nothing to the mesh. ``args`` itself
        when none does."""
        leaves, tree = jax.tree.flatten(args)
        committed = [isinstance(x, _ArrayImpl) and x.committed for x in leaves]
        targets = self._shardings_per_plan(args) if any(committed) else None
        if targets is None:
            return args
        shardings, _ = targets
        moved = [_elsewhere(x, sharding.mesh) for x, sharding in zip(leaves, shardings)]
        if not any(moved):
            return args
        leaves = [jax.device_put(_untyped_by_stale_mesh(x), sharding) if m else x
                  for x, sharding, m in zip(leaves, shardings, moved)]
        return jax.tree.unflatten(tree, leaves)

    def _typed_per_plan(self, args: tuple) -> tuple:
        """For ``lower``: the inputs that carry no sharding of their own
        (NumPy arrays, scalars, uncommitted arrays, bare ShapeDtypeStructs), as
        ShapeDtypeStructs sharded per the plan on the mesh, so the compiled
        program's ``input_shardings`` are NamedShardings with the plan's specs,
        as ``jax.jit(..., in_shardings=...)`` gives (not bare GSPMDShardings)."""
        targets = self._shardings_per_plan(args)
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

    def _shardings_per_plan(self, args: tuple) -> tuple[list[NamedSharding], bool] | None:
        """(each input's sharding per the plan on the mesh in scope, replicated
        where the plan maps nothing to the mesh; whether the plan uses mesh
        axes), or None without a mesh or inside a manual region."""
        mesh = mesh_in_scope()
        if mesh is None or _mesh_lib.get_abstract_mesh().manual_axes:
            return None
        rules = current_axis_rules() if self._follows_rule_context else None
        plan, flat_specs = self._plan(args, mesh, self._resources_for(rules))
        shapes = [_shape(x) for x in jax.tree.leaves(args)]
        on_mesh = plan.mesh is not None
        return [NamedSharding(mesh, plan.partition_spec(spec, len(shape)) if on_mesh
                              else PartitionSpec())
                for shape, spec in zip(shapes, flat_specs)], on_mesh


def _full_rank(sharding: NamedSharding, ndim: int) -> NamedSharding:
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


def _checked_backend(backend: str | None) -> str | None:
    """``backend`` as jax.jit takes it (lowercased; 'gpu' stays JAX's alias
    for whichever GPU platform is present); an unknown name is an NxopsError."""
    if backend is None:
        return None
    normalize_platform(backend, f"nx.xmap(..., backend={backend!r})")
    return str(backend).lower()


def _present(backend: str) -> str:
    """``backend``, checked present in this process (jax.jit's own error,
    "Unknown backend: 'gpu'", reads as if the name were wrong)."""
    try:
        jax.devices(backend)
    except RuntimeError as e:
        platform = normalize_platform(backend, "nx.xmap")
        alias = " ('gpu' means 'cuda': NVIDIA GPUs)" if backend == "gpu" else ""
        raise NxopsError(
            f"nx.xmap(..., backend={backend!r}): this process has no {platform} devices"
            f"{alias}; JAX's default backend here is {jax.default_backend()!r}. Leave "
            f"backend unset to run on the default devices, or run where {platform} devices "
            f"are visible (check jax.devices({backend!r})).") from e
    return backend


def _unsharded_type(x):
    """A nested xmap's result, typed replicated over the mesh axes its type is
    sharded on: the enclosing body sees values, whatever the placement (typed
    sharded over an Explicit axis, even slicing the named dim fails)."""
    spec = jax.typeof(x).sharding.spec
    if all(entry is None for entry in spec):
        return x
    return jax.sharding.reshard(x, PartitionSpec(*[None] * x.ndim))


# fun -> {definition: {context: jitted}}. Two nx.xmap objects built from the
# same function object with equal specs, sizes, resources, donation and
# backend share their jitted programs, so `fun` is traced once (as jax.jit and
# the old xmap do). Keyed by the function's identity, held weakly: a new
# closure is a new function (it may capture other values) and shares nothing.
_SHARED: "weakref.WeakKeyDictionary[Callable, dict]" = weakref.WeakKeyDictionary()


def _hashable_tree(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return tuple(leaves), treedef


def _shared_jits(fun: Callable, definition: tuple) -> dict:
    try:
        return _SHARED.setdefault(fun, {}).setdefault(definition, {})
    except TypeError:   # fun not weak-referenceable, or a definition part unhashable
        return {}


def _as_array(x: Any) -> Any:
    """An argument as jax.jit passes it on (Python scalars weakly typed)."""
    return x if isinstance(x, jax.Array) else jax.numpy.asarray(x)


def _committed_elsewhere(args: tuple) -> bool:
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


class _InputsOnAnotherMesh(NxopsError):
    """An input typed on another mesh than the xmap's. Raised while tracing;
    a call with concrete arrays moves them onto the mesh and runs again, so
    users see it only for traced inputs (inside jax.jit, jax.grad, ...)."""


def _refuse_inputs_on_another_mesh(args: tuple, plan: Plan, flat_specs: list) -> None:
    """Raises _InputsOnAnotherMesh for an input typed on a mesh other than
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
        raise _InputsOnAnotherMesh(
            f"xmap argument args{jax.tree_util.keystr(path)} lives on another mesh, "
            f"{_show_mesh(typed_on)}, but this xmap runs under mesh {_show_mesh(mesh)}. "
            f"One program cannot hold both meshes (JAX refuses it, and XLA may abort the "
            f"process). nxops moves concrete arrays itself; a traced one (inside jax.jit, "
            f"jax.grad, jax.vmap, ...) cannot be moved there. Move it before the transformation: "
            f"x = jax.device_put(x, jax.NamedSharding(mesh, {pspec})), or make it under the "
            f"mesh the xmap runs on.")


def _replicated_off_mesh(args: tuple) -> tuple:
    """With no mesh in scope, inputs typed as split over a mesh (made under
    ``jax.set_mesh`` on Explicit axes) retyped replicated on it: the body's
    ``jax.vmap`` refuses to map inputs whose types split them differently
    ("Mapped away dimension of inputs passed to vmap should be sharded the
    same"). Under a mesh, ``_refuse_inputs_on_another_mesh`` decides."""
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


def _context_probe() -> tuple:
    """The objects that make up a call's context: the ``jax.set_mesh`` mesh
    (None when unset), the legacy ``with mesh:`` one, serial loops, enclosing
    names and axis rules. Cheap reads only: it runs on every call, and a probe
    equal to the last call's means an unchanged context."""
    return (_device_context.value, _legacy_meshes.value,
            loops_in_scope(), current_logical_axes_map(), current_axis_rules())


def _concrete_mesh_unset() -> bool:
    current = _mesh_lib.get_concrete_mesh()
    return current is None or current.empty


def xmap(fun: Callable[..., Any], in_axes: Any, out_axes: Any, *,
         axis_sizes: Mapping[str, int] | None = None,
         axis_resources: AxisResources | None = None,
         donate_argnums: int | Sequence[int] = (), backend: str | None = None) -> XmapFunction:
    """Maps ``fun`` over named axes (the model of the removed ``jax.experimental.maps.xmap``).

    Args:
      fun: the body; it sees each argument with its named dimensions removed and
        may use named ops (``nx.sum(x, 'batch')``, ``nx.psum``, ``nx.pdot``, ...).
      in_axes: per argument a spec: a list of names (None for a positional dim,
        optionally ending with ``...``; without it the list asserts the rank) or a
        dict ``{position: name}``; a pytree prefix of the arguments.
      out_axes: the same for the results; names that appear in no input need
        ``axis_sizes`` and are broadcast.
      axis_sizes: ``{name: size}`` for names not inferable from the arguments.
      axis_resources: ``{name: mesh_axis | (mesh_axis, ...) | SerialLoop(n) |
        loop_name | (mesh axes..., loops...)}``, or a flax-style rule table
        ``[(name, mesh_axes | None), ...]`` (priority semantics, see
        ``nx.axis_rules``); when omitted, the ``nx.axis_rules`` in scope at the
        call (if any) decides. The mesh comes from
        ``jax.set_mesh(mesh)`` (or the legacy ``with mesh:``), loop names from
        ``nx.serial_loop``. Resources never change results, only where and how
        the work runs.
      donate_argnums: as for ``jax.jit``.
      backend: as for ``jax.jit``.

    Returns:
      A callable (also ``.lower(*args)`` -> ``jax.stages.Lowered``) whose plan
      and compiled program are cached per argument signature.

    Examples:
        >>> f = nx.xmap(lambda x: x - nx.mean(x, 'batch'), in_axes=['batch', ...],
        ...             out_axes=['batch', ...])
        >>> print(f(jnp.array([[1., 2.], [3., 6.]])))
        [[-1. -2.]
         [ 1.  2.]]
    """
    return XmapFunction(fun, in_axes, out_axes, axis_sizes=axis_sizes,
                        axis_resources=axis_resources, donate_argnums=donate_argnums,
                        backend=backend)
