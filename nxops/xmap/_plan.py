"""The plan: each logical axis -> (mesh axes, serial loops, local vmap tile).

Along a logical axis of size ``N`` mapped to mesh axes of total size ``M`` and
loops of lengths ``L1..Lk``, the global position is
``mesh_index * (L1..Lk * T) + loop_indices * T + tile_index`` with
``T = N / (M * L1..Lk)``: mesh axes are major, loops next, the vmap tile minor.

A name carried by mesh axes alone (``T == 1``, no loops) gets no vmap level:
a size-1 ``vmap`` would only add size-1 dimensions, which cost transposes and
copies in the compiled program that a hand-written ``shard_map`` does not have.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import math
from typing import Any, Sequence, Union

import jax
from jax.sharding import Mesh, PartitionSpec

from nxops._jax import mesh_lib as _mesh_lib
from nxops._errors import NxopsError
from nxops.ops._axis_env import InternalAxisName, LogicalAxis, current_logical_axes
from nxops.xmap._resources import NamedLoop, SerialLoop, loops_in_scope
from nxops.xmap._specs import AxisSpec

Loop = Union[SerialLoop, NamedLoop]
# A resource as written by the user: a mesh axis or loop name, or a SerialLoop.
UserResource = Union[str, SerialLoop]


@dataclasses.dataclass(frozen=True)
class AxisPlan:
    """How one logical axis runs."""

    name: str
    size: int
    mesh_axes: tuple[str, ...]
    loops: tuple[Loop, ...]
    tile: int
    vmap_name: str | InternalAxisName
    # True keeps a vmap level even for a tile of 1 (the fallback when the
    # body's variance cannot be analysed, or a cond's branches would differ
    # per device around a collective: see _program.NeedsVmapLevels).
    force_vmap: bool = False

    @property
    def resources(self) -> tuple[Any, ...]:
        return self.mesh_axes + self.loops

    @property
    def vmapped(self) -> bool:
        """Whether the name has a local vmap level: not when mesh axes alone
        carry it (a loop keeps it, since positions put the tile after the loop
        steps)."""
        return self.force_vmap or not (self.tile == 1 and self.mesh_axes and not self.loops)

    def logical_axis(self) -> LogicalAxis:
        tile = (self.vmap_name,) if self.vmapped else ()
        return LogicalAxis(physical=self.mesh_axes + tile, loops=self.loops)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The plan of one xmap call (cached per argument signature)."""

    axes: tuple[AxisPlan, ...]
    loops: tuple[Loop, ...]
    mesh: Mesh | None
    mesh_axes: tuple[str, ...]

    def axis(self, name: str) -> AxisPlan:
        return self._axes_by_name[name]

    @functools.cached_property
    def _axes_by_name(self) -> dict[str, AxisPlan]:
        """(Read at every dimension of every operand and result of a lowering.)"""
        return {a.name: a for a in self.axes}

    def partition_spec(self, spec: AxisSpec, ndim: int) -> PartitionSpec:
        by_pos = spec.mapping
        entries = []
        for dim in range(ndim):
            axes = self.axis(by_pos[dim]).mesh_axes if dim in by_pos else ()
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        while entries and entries[-1] is None:   # as users write them: P('x'), not P('x', None)
            entries.pop()
        return PartitionSpec(*entries)

    def logical_axes(self) -> dict[str, LogicalAxis]:
        return {a.name: a.logical_axis() for a in self.axes}

    def unvmapped(self) -> tuple[str, ...]:
        """The names that run without a vmap level (carried by mesh axes alone)."""
        return tuple(a.name for a in self.axes if not a.vmapped)

    def with_vmap_levels(self) -> "Plan":
        """The same plan with a vmap level for every name (tiles of 1 included)."""
        axes = tuple(dataclasses.replace(a, force_vmap=True) for a in self.axes)
        return dataclasses.replace(self, axes=axes)


def _show(resources: Sequence[Any]) -> str:
    return "(" + ", ".join(r.name if isinstance(r, SerialLoop) else repr(r) for r in resources) + ")"


def normalize_axis_resources(axis_resources: Any, defined: Sequence[str]) -> dict[str, tuple]:
    """Checks ``axis_resources`` against the defined names (at xmap time)."""
    if axis_resources is None:
        return {}
    if not isinstance(axis_resources, dict):
        raise NxopsError(
            f"xmap axis_resources must be a dict from axis name to resources, e.g. "
            f"{{'batch': 'x'}}, but got {axis_resources!r}.")
    missing = [name for name in axis_resources if name not in defined]
    if missing:
        raise NxopsError(
            f"All axes that were assigned resources have to appear in in_axes or "
            f"axis_sizes, but the following are missing: {', '.join(map(repr, missing))} "
            f"(axis_resources={axis_resources!r}; defined axes: "
            f"{', '.join(map(repr, defined)) or 'none'}).")
    normalized = {}
    for name, value in axis_resources.items():
        resources = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        for r in resources:
            if not isinstance(r, (str, SerialLoop)):
                raise NxopsError(
                    f"axis_resources[{name!r}] = {value!r}: a resource is a mesh axis "
                    f"name, a serial_loop name (str) or a SerialLoop(n), or a tuple of them.")
        if len(set(resources)) != len(resources):
            raise NxopsError(
                f"Resource assignment of a single axis must be a tuple of distinct "
                f"resources, but specified {_show(resources)} for axis {name!r}.")
        normalized[name] = resources
    return normalized


class NeedsMesh(Exception):
    """An xmap traced off the mesh (its own plan uses no mesh axis: see
    ``_mesh_calls.OffMesh``) contains a nested xmap whose plan uses mesh axes, so
    the outer one must run on the mesh after all."""


# The mesh in scope at the call of an xmap traced off the mesh (None: not off).
_OFF_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "nxops_off_mesh", default=None)


@contextlib.contextmanager
def off_mesh(mesh: Mesh):
    """Traces an xmap body with ``mesh`` hidden; nested plans that would use
    it raise NeedsMesh."""
    token = _OFF_MESH.set(mesh)
    try:
        yield
    finally:
        _OFF_MESH.reset(token)


def mesh_in_scope() -> Mesh | None:
    """The mesh of ``jax.set_mesh(mesh)``, else of the legacy ``with mesh:``."""
    mesh = _mesh_lib.get_concrete_mesh()
    if mesh is None or mesh.empty:
        mesh = _mesh_lib.thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def _resolve(name: str, resources: tuple, mesh: Mesh | None,
             loops: dict[str, NamedLoop]) -> tuple[list[str], list[Loop], list[str]]:
    mesh_axes, axis_loops, missing = [], [], []
    mesh_names = set(mesh.axis_names) if mesh is not None else set()
    for r in resources:
        if isinstance(r, SerialLoop):
            axis_loops.append(r)
        elif r in mesh_names and r in loops:
            raise NxopsError(
                f"axis_resources[{name!r}] names {r!r}, which is both a mesh axis and a "
                f"serial_loop in scope; rename the loop.")
        elif r in mesh_names:
            mesh_axes.append(r)
        elif r in loops:
            axis_loops.append(loops[r])
        else:
            missing.append(r)
    return mesh_axes, axis_loops, missing


def _symbolic_size_hint(size: Any, total: int) -> str:
    """A symbolic size (jax.export) is divisible only if it is written as a
    multiple: say how to write one."""
    return (f"A symbolic size must be declared as a multiple of {total}: export with "
            f"{total}*{size} in its place, e.g. jax.export.symbolic_shape('{total}*{size}, ...') "
            f"or `{size}, = jax.export.symbolic_shape('{size}')` and a dimension of {total} * {size}.")


def _vmap_name(name: str, mesh_axes, loops, mesh: Mesh | None) -> str | InternalAxisName:
    # The logical name itself, so that raw lax.psum(x, name) works in the body,
    # unless a mesh axis or loop also carries the axis (or the name is a mesh
    # axis): then a name no user name can equal (a user may name an axis 'a#tile').
    if mesh_axes or loops or (mesh is not None and name in mesh.axis_names):
        return InternalAxisName(f"{name}#tile")
    return name


def show_resource(resource: Any) -> str:
    """A resource as messages show it: a mesh axis quoted, a loop by name."""
    return resource.name if isinstance(resource, (SerialLoop, NamedLoop)) else repr(resource)


def check_shared_resources(plan: Plan, spec: AxisSpec, what: str) -> None:
    """Two names of one value may not share a resource (the value would be split
    twice along it)."""
    owner: dict[Any, str] = {}
    for name in spec.axis_names:
        for r in plan.axis(name).resources:
            if r in owner:
                raise NxopsError(
                    f"Axes {owner[r]!r} and {name!r} are both mapped to the resource "
                    f"{show_resource(r)}, but they coincide in {what} with specification "
                    f"{spec.user_repr}: one value cannot be split along one resource "
                    f"twice. Map them to different resources.")
            owner[r] = name


def plan_axis_resources(sizes: dict[str, int], axis_resources: dict[str, tuple],
                        order: Sequence[str]) -> Plan:
    """Resolves resources against the mesh and loops in scope and checks sizes."""
    hidden = _OFF_MESH.get()
    mesh = hidden if hidden is not None else mesh_in_scope()
    loops = {loop.name: loop for loop in loops_in_scope()}
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    enclosing = current_logical_axes()   # the names of enclosing xmaps
    axes, all_missing = [], []
    for name in order:
        resources = axis_resources.get(name, ())
        mesh_axes, axis_loops, missing = _resolve(name, resources, mesh, loops)
        all_missing += [(name, r) for r in missing]
        if missing:
            continue
        busy = [a for a in mesh_axes if a in manual]
        if busy:
            raise NxopsError(
                f"axis_resources[{name!r}] uses mesh axes {busy}, which an enclosing "
                f"xmap or shard_map already maps over; use other mesh axes.")
        looped = [(loop, outer) for loop in axis_loops for outer, axis in enclosing.items()
                  if loop in axis.loops]
        if looped:
            loop, outer = looped[0]
            raise NxopsError(
                f"axis_resources[{name!r}] uses the serial loop {loop.name!r}, which "
                f"the enclosing xmap already loops over for its name {outer!r}: a nested xmap "
                f"cannot split its names along the same loop again. Give the inner name "
                f"another loop (`with nx.serial_loop(other_name, length):` around the call, "
                f"or SerialLoop(length)), or map both names in one xmap to share the loop.")
        total = math.prod(mesh.shape[a] for a in mesh_axes) * math.prod(
            loop.length for loop in axis_loops)
        if sizes[name] % total and not isinstance(sizes[name], int):
            raise NxopsError(
                f"The size of axis {name!r} is the symbolic {sizes[name]}, which jax.export "
                f"cannot prove divisible by the total size {total} of the resources assigned "
                f"to it, {_show(resources)}{_mesh_note(mesh, mesh_axes)}. "
                + _symbolic_size_hint(sizes[name], total))
        if sizes[name] % total:
            raise NxopsError(
                f"The size of axis {name!r} ({sizes[name]}) is not divisible by the total "
                f"size of the resources assigned to it, {_show(resources)} of total size "
                f"{total}{_mesh_note(mesh, mesh_axes)}. Assign resources whose sizes "
                f"multiply to a divisor of {sizes[name]}.")
        axes.append(AxisPlan(name, sizes[name], tuple(mesh_axes), tuple(axis_loops),
                             sizes[name] // total, _vmap_name(name, mesh_axes, axis_loops, mesh)))
    if all_missing:
        raise _missing_resources_error(all_missing, mesh, loops)
    used_loops = tuple(dict.fromkeys(loop for a in axes for loop in a.loops))
    used_mesh = tuple(a for a in (mesh.axis_names if mesh is not None else ())
                      if any(a in p.mesh_axes for p in axes))
    if used_mesh and hidden is not None:
        raise NeedsMesh()
    return Plan(tuple(axes), used_loops, mesh if used_mesh else None, used_mesh)


def _missing_resources_error(missing: list[tuple[str, Any]], mesh: Mesh | None,
                             loops: dict) -> NxopsError:
    """Resources that name neither a mesh axis nor a loop in scope. Without a
    mesh, the fix is likely to set one; with one, the name is likely wrong."""
    names = ", ".join(dict.fromkeys(repr(r) for _, r in missing))
    head = (f"In-scope resources are insufficient to execute the xmapped function. The "
            f"missing resources are: {names}")
    in_scope = f"serial loops in scope: {list(loops) or 'none'}"
    if mesh is None:
        return NxopsError(
            f"{head}. Mesh axes in scope: none; {in_scope}. Call it under "
            f"jax.set_mesh(mesh) or inside `with nx.serial_loop(name, length):`.")
    axes = [str(a) for a in mesh.axis_names]
    which = "; ".join(
        f"axis_resources[{name!r}] names {r!r}, which the mesh in scope does not have"
        + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(str(r), axes, n=1))
           else "")
        for name, r in missing)
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return NxopsError(
        f"{head}: {which}. The mesh in scope has axes {axes} ({sizes}); {in_scope}. "
        f"Name the mesh's axes in axis_resources, or call it under a mesh with those "
        f"axes (jax.set_mesh(mesh)); a name that is a loop needs "
        f"`with nx.serial_loop(name, length):` around the call.")


def _mesh_note(mesh: Mesh | None, mesh_axes: Sequence[str]) -> str:
    if not mesh_axes:
        return ""
    return " (mesh axis sizes: " + ", ".join(f"{a}={mesh.shape[a]}" for a in mesh_axes) + ")"
