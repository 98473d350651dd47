"""``nx.xmap``: named-axis programming on top of vmap, shard_map and scan."""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import Mesh

from nxops._jax import device_context as _device_context     # what jax.set_mesh sets
from nxops._jax import legacy_mesh_context as _legacy_meshes   # what `with mesh:` sets
from nxops._jax import mesh_lib as _mesh_lib
from nxops._jax import staging_into_jaxpr as _staging_into_jaxpr
from nxops._errors import NxopsError
from nxops._traceback import api_boundary
from nxops._platforms import normalize_platform
from nxops._typing import AxisResources
from nxops.ops._axis_env import current_logical_axes_map
from nxops.xmap import _trace as trace
from nxops.xmap._definition import Definition, shape_of
from nxops.xmap._inputs import (InputsOnAnotherMesh, as_array, committed_elsewhere, full_rank,
                                place_on_mesh, typed_per_plan)
from nxops.xmap._mesh_calls import MadeOnFirstUse, names_mesh_axes, OffMesh, UnderMesh
from nxops.xmap._plan import mesh_in_scope
from nxops.xmap._resources import loops_in_scope
from nxops.xmap._rules import current_axis_rules
from nxops.xmap._xmap_errors import explained_value_error, non_array_argument_error


class XmapFunction:
    """The callable ``nx.xmap`` returns. It keeps one ``jax.jit`` per context
    (mesh, serial loops and enclosing named axes in scope); jit caches the
    plan's program per argument structure, shapes, dtypes and shardings."""

    def __init__(self, fun: Callable, in_axes: Any, out_axes: Any, *,
                 axis_sizes: dict[str, int] | None, axis_resources: dict | None,
                 donate_argnums: int | Sequence[int], backend: str | None):
        self._definition = Definition.define(
            fun, in_axes, out_axes, axis_sizes=axis_sizes, axis_resources=axis_resources,
            donate_argnums=donate_argnums, backend=backend)
        self._by_context: dict[tuple, Any] = _shared_jits(fun, self._definition.key())
        # (context probe, its jitted program, the program to trace inline) of
        # the last call; () matches no probe.
        self._last_context: tuple = ((), None, None)
        functools.update_wrapper(self, fun, updated=())   # not __dict__: fun may be an xmap

    def __repr__(self) -> str:
        d = self._definition
        return (f"nx.xmap({getattr(d.fun, '__name__', d.fun)}, "
                f"in_axes={d.user_in_axes!r}, out_axes={d.user_out_axes!r})")

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
        except InputsOnAnotherMesh as e:
            # Arrays typed on another mesh: moved here, outside any trace (one
            # program holding both meshes can abort the process in XLA).
            placed = place_on_mesh(self._definition, args)
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
            if isinstance(e, NxopsError) or not committed_elsewhere(args):
                raise
        # Inputs committed to devices other than the mesh's: move them, then retry.
        return jitted(*place_on_mesh(self._definition, args))

    def _call_traced(self, traced: Callable, args: tuple) -> Any:
        """The program traced inline into the enclosing trace (a jax.jit,
        jax.grad, ...), with no jit of its own: a nested jit would be traced,
        then linearized and lowered as a second function, and the enclosing
        transformation caches the whole trace anyway."""
        error = non_array_argument_error(args)
        if error is not None:
            raise error
        try:
            return traced(*jax.tree.map(as_array, args))
        except InputsOnAnotherMesh as e:
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
            placed = place_on_mesh(self._definition, args)
            return self._jitted()[0].lower(*typed_per_plan(self._definition, placed))
        except InputsOnAnotherMesh as e:
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
        targets = self._definition.shardings(args)
        if targets is None:
            raise NxopsError(
                f"{self!r}.in_shardings(...) needs the mesh the program runs on: call it "
                f"under jax.set_mesh(mesh) (or `with mesh:`), outside any xmap or shard_map "
                f"body. Without a mesh the program runs on one device and any placement works.")
        leaves, tree = jax.tree.flatten(args)
        return jax.tree.unflatten(tree, [full_rank(s, len(shape_of(x)))
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
        rules = rules if self._definition.follows_rule_context else None
        # Whether jax.set_mesh is unset (the legacy `with mesh:` alone) is part
        # of the key: the program is then wrapped to call it under the mesh.
        key = (mesh_in_scope(), _concrete_mesh_unset(), loops, tuple(names.items()), rules)
        programs = self._by_context.get(key)
        if programs is None:
            resources = self._definition.resources_for(rules)
            programs = self._by_context[key] = self._make_jitted(key[0], resources)
        self._last_context = (probe, *programs)
        return programs

    def _make_jitted(self, mesh: Mesh | None, resources: dict) -> tuple[Callable, Callable]:
        """(the jitted program for a call outside any trace, the function it
        jits, for a call inside one)."""
        definition = self._definition

        def run(*args):
            return trace.run(definition, mesh, resources, args)

        run.__name__ = getattr(definition.fun, "__name__", "xmapped")
        backend = definition.backend
        jit_kwargs = {"backend": _present(backend)} if backend is not None else {}
        concrete_mesh_unset = _concrete_mesh_unset()

        def make() -> Callable:
            jitted = jax.jit(run, donate_argnums=definition.donate_argnums, **jit_kwargs)
            on_mesh = jitted if mesh is None or not concrete_mesh_unset else UnderMesh(mesh, jitted)
            if mesh is None or names_mesh_axes(resources, mesh) or jax.process_count() > 1:
                return on_mesh
            return OffMesh(mesh, jitted, on_mesh)
        return MadeOnFirstUse(make), run


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


# fun -> {definition: {context: jitted}}. Two nx.xmap objects built from the
# same function object with equal specs, sizes, resources, donation and
# backend share their jitted programs, so `fun` is traced once (as jax.jit and
# the old xmap do). Keyed by the function's identity, held weakly: a new
# closure is a new function (it may capture other values) and shares nothing.
_SHARED: "weakref.WeakKeyDictionary[Callable, dict]" = weakref.WeakKeyDictionary()


def _shared_jits(fun: Callable, definition: tuple) -> dict:
    try:
        return _SHARED.setdefault(fun, {}).setdefault(definition, {})
    except TypeError:   # fun not weak-referenceable, or a definition part unhashable
        return {}


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
