"""``nx.xmap``: named-axis programming on top of vmap, shard_map and scan."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
from jax._src import core as _core
from jax.sharding import Mesh, NamedSharding

from nxops._errors import NxopsError
from nxops.ops._axis_env import current_logical_axes, logical_axes
from nxops.xmap._plan import (Plan, check_shared_resources, mesh_in_scope,
                              normalize_axis_resources, plan_axis_resources)
from nxops.xmap._program import build_program
from nxops.xmap._resources import loops_in_scope
from nxops.xmap._specs import (AxisSpec, broadcast_specs, infer_axis_sizes, parse_spec_tree,
                               spec_leaves, spec_names)

# The mesh in scope when the enclosing xmap was called (None: no enclosing xmap).
_ENCLOSING_MESH: contextvars.ContextVar[tuple[Mesh | None] | None] = contextvars.ContextVar(
    "nxops_enclosing_xmap_mesh", default=None)


@contextlib.contextmanager
def _enclosing_mesh(mesh: Mesh | None):
    token = _ENCLOSING_MESH.set((mesh,))
    try:
        yield
    finally:
        _ENCLOSING_MESH.reset(token)


def _leaf_signature(x: Any) -> tuple:
    if isinstance(x, _core.Tracer):
        return (x.shape, x.dtype)
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, x.sharding if x.committed else None)
    return (type(x), getattr(x, "shape", None), getattr(x, "dtype", None))


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(getattr(x, "shape", None) if hasattr(x, "shape") else jax.numpy.shape(x))


@dataclasses.dataclass
class _Compiled:
    """The plan and jitted program for one argument signature."""

    plan: Plan
    jitted: Any
    in_tree: Any
    puts: tuple[tuple[int, NamedSharding], ...]   # committed inputs on other devices
    set_mesh: bool                                # legacy `with mesh:` only

    def _prepare(self, args: tuple) -> tuple:
        if not self.puts:
            return args
        leaves = jax.tree.leaves(args)
        for i, sharding in self.puts:
            leaves[i] = jax.device_put(leaves[i], sharding)
        return jax.tree.unflatten(self.in_tree, leaves)

    def _context(self):
        return jax.set_mesh(self.plan.mesh) if self.set_mesh else contextlib.nullcontext()

    def __call__(self, args: tuple):
        args = self._prepare(args)
        with self._context():
            return self.jitted(*args)

    def lower(self, args: tuple):
        args = self._prepare(args)
        with self._context():
            return self.jitted.lower(*args)


class XmapFunction:
    """The callable ``nx.xmap`` returns: caches a plan and a jitted program per
    argument signature (pytree structure, shapes, dtypes, placement, and the
    mesh, loops and enclosing named axes in scope)."""

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
            if not isinstance(size, int) or size < 1:
                raise NxopsError(f"axis_sizes[{name!r}] = {size!r}: sizes are positive ints.")
        in_names = spec_names(self._in_axes)
        self._names = list(dict.fromkeys(in_names + list(self._axis_sizes)
                                         + spec_names(self._out_axes)))
        defined = set(in_names) | set(self._axis_sizes)
        missing = [n for n in spec_names(self._out_axes) if n not in defined]
        if missing:
            raise NxopsError(
                f"All axis names appearing in out_axes must also appear in in_axes or "
                f"axis_sizes, but the following are missing: {', '.join(map(repr, missing))} "
                f"(out_axes={out_axes!r}). Give their sizes with axis_sizes={{name: size}}.")
        self._resources = normalize_axis_resources(axis_resources, list(dict.fromkeys(
            in_names + list(self._axis_sizes))))
        self._donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self._backend = backend
        self._cache: dict[tuple, _Compiled] = {}
        functools.update_wrapper(self, fun)

    def __repr__(self) -> str:
        return (f"nx.xmap({getattr(self._fun, '__name__', self._fun)}, "
                f"in_axes={self._user_in_axes!r}, out_axes={self._user_out_axes!r})")

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise NxopsError("xmapped functions take positional arguments only "
                             f"(got keywords {sorted(kwargs)}).")
        return self._compiled(args)(args)

    def lower(self, *args) -> jax.stages.Lowered:
        """Lowers for these arguments (``.compile()``, ``.as_text()``, ...)."""
        return self._compiled(args).lower(args)

    # -- planning --------------------------------------------------------

    def _compiled(self, args: tuple) -> _Compiled:
        leaves, tree = jax.tree.flatten(args)
        mesh = mesh_in_scope()
        key = (tree, tuple(map(_leaf_signature, leaves)), mesh, loops_in_scope(),
               tuple(current_logical_axes().items()), jax.sharding.get_abstract_mesh())
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache[key] = self._build(args, leaves, tree, mesh)
        return compiled

    def _build(self, args: tuple, leaves: list, tree, mesh: Mesh | None) -> _Compiled:
        enclosing = _ENCLOSING_MESH.get()
        if enclosing is not None and enclosing[0] != mesh:
            raise NxopsError(
                f"Changing the physical mesh is not allowed inside xmap: the enclosing "
                f"xmap was called with mesh {enclosing[0]} in scope, but this call sees "
                f"{mesh}. Set the mesh once, around the outermost xmap.")
        shadowed = [n for n in self._names if n in current_logical_axes()]
        if shadowed:
            raise NxopsError(
                f"Nested xmaps cannot shadow names of enclosing ones: "
                f"{', '.join(map(repr, shadowed))} already named by an enclosing xmap. "
                f"Rename the inner axes (the inner body may use the outer names).")
        flat_specs = broadcast_specs(self._in_axes, args, "in_axes", self._user_in_axes)
        paths = [f"args{jax.tree_util.keystr(p)}"
                 for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
        shapes = [_shape(x) for x in leaves]
        sizes = infer_axis_sizes(flat_specs, shapes, paths, self._axis_sizes)
        unknown = [n for n in self._names if n not in sizes]
        if unknown:
            raise NxopsError(
                f"Failed to infer size of axes: {', '.join(map(repr, unknown))}. You've "
                f"probably passed in empty containers in place of arguments that had "
                f"those axes in their in_axes. Provide the sizes of missing axes "
                f"explicitly via axis_sizes to fix this error.")
        plan = plan_axis_resources(sizes, self._resources, self._names)
        for spec, path in zip(flat_specs, paths):
            check_shared_resources(plan, spec, f"argument {path}")
        program, outputs = build_program(self._fun, plan, tree, flat_specs,
                                         self._out_axes, self._user_out_axes)
        env = plan.logical_axes()

        def run(*call_args):
            with logical_axes(env), _enclosing_mesh(mesh):
                results = program(*jax.tree.leaves(call_args))
            return jax.tree.unflatten(outputs.tree, results)

        run.__name__ = getattr(self._fun, "__name__", "xmapped")
        jit_kwargs = {"backend": self._backend} if self._backend is not None else {}
        jitted = jax.jit(run, donate_argnums=self._donate_argnums, **jit_kwargs)
        return _Compiled(plan, jitted, tree, self._placements(plan, flat_specs, leaves),
                         plan.mesh is not None and _core_mesh_unset())

    @staticmethod
    def _placements(plan: Plan, flat_specs: list[AxisSpec], leaves: list):
        if plan.mesh is None or jax.sharding.get_abstract_mesh().manual_axes:
            return ()
        devices = set(plan.mesh.devices.flat)
        puts = []
        for i, (x, spec) in enumerate(zip(leaves, flat_specs)):
            if (isinstance(x, jax.Array) and not isinstance(x, _core.Tracer) and x.committed
                    and x.sharding.device_set != devices):
                puts.append((i, NamedSharding(plan.mesh, plan.partition_spec(spec, x.ndim))))
        return tuple(puts)


def _core_mesh_unset() -> bool:
    from jax._src import mesh as mesh_lib
    current = mesh_lib.get_concrete_mesh()
    return current is None or current.empty


def xmap(fun: Callable, in_axes: Any, out_axes: Any, *,
         axis_sizes: dict[str, int] | None = None, axis_resources: dict | None = None,
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
        loop_name | (mesh axes..., loops...)}``; the mesh comes from
        ``jax.set_mesh(mesh)`` (or the legacy ``with mesh:``), loop names from
        ``nx.serial_loop``. Resources never change results, only where and how
        the work runs.
      donate_argnums, backend: as for ``jax.jit``.

    Returns:
      A callable (also ``.lower(*args)`` -> ``jax.stages.Lowered``) that caches
      its plan and compiled program per argument signature.
    """
    return XmapFunction(fun, in_axes, out_axes, axis_sizes=axis_sizes,
                        axis_resources=axis_resources, donate_argnums=donate_argnums,
                        backend=backend)
