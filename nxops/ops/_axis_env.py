"""Resolution of axis names used by named ops.

A name given to an nxops op is *logical*. Inside an ``nx.xmap`` body the
frontend maps each logical name to the physical axes that carry it, major to
minor: mesh axes of the enclosing ``shard_map`` and/or the name of a local
``vmap`` tile. Outside xmap (plain ``jax.vmap(axis_name=...)`` or
``jax.shard_map`` bodies) a name is its own physical axis.

Physical names are then split into *vmap names* (handled by nxops primitives'
batching rules, so the work becomes positional and runs in a kernel) and
*mesh names* (manual axes of an enclosing ``shard_map``, handled by one
collective).
"""
from __future__ import annotations

import contextlib
import difflib
import contextvars
import dataclasses
import types
from typing import Callable, Iterator, Mapping, Sequence

import jax

from nxops._jax import core as _core
from nxops._jax import enclosing_batch_axes as _enclosing_batch_axes
from nxops._jax import bound_axis_sizes as _bound_axis_sizes
from nxops._jax import wrap_custom_rules as _wrap_custom_rules
from nxops._errors import NxopsError
from nxops._jax import mesh_lib as _mesh
from nxops.kernels import _reports


class InternalAxisName:
    """A vmap axis name nxops binds itself (an xmap name's local tile, the
    positions of a collective computed positionally). Not a string, so no
    user axis name can be equal to it, however it is spelled. Like
    ``TileAxisName`` it may carry the logical names bound where its vmap
    level was made (equality and hash ignore them)."""

    __slots__ = ("label", "logical")

    def __init__(self, label: str, logical: dict | None = None):
        self.label, self.logical = label, dict(logical or {})

    def with_logical(self, logical: dict) -> "InternalAxisName":
        return InternalAxisName(self.label, logical)

    def __eq__(self, other) -> bool:
        return type(other) is InternalAxisName and other.label == self.label

    def __hash__(self) -> int:
        return hash((InternalAxisName, self.label))

    def __str__(self) -> str:
        return self.label

    __repr__ = __str__


@dataclasses.dataclass(frozen=True)
class LogicalAxis:
    """How one logical name is carried: ``physical`` names, major to minor
    (mesh axes, then the local vmap tile last), and ``loops``: the serial-loop
    resources (objects with ``.name`` and ``.length``) whose steps sit between
    the mesh axes and the tile. Position queries see the loops (a position is
    global); collectives over a looped axis are not allowed, since each loop
    step only sees one chunk."""

    physical: tuple[str, ...]
    loops: tuple = ()


# The defaults are read-only: a block installs a new mapping, never edits one.
_LOGICAL_AXES: contextvars.ContextVar[Mapping[str, LogicalAxis]] = contextvars.ContextVar(
    "nxops_logical_axes", default=types.MappingProxyType({}))
# The current step (a traced int) of each serial loop whose body is being traced.
_LOOP_STEPS: contextvars.ContextVar[Mapping] = contextvars.ContextVar(
    "nxops_loop_steps", default=types.MappingProxyType({}))


@contextlib.contextmanager
def loop_step(loop, step) -> Iterator[None]:
    """Binds the step index of ``loop`` while one step of its scan is traced."""
    token = _LOOP_STEPS.set({**_LOOP_STEPS.get(), loop: step})
    try:
        yield
    finally:
        _LOOP_STEPS.reset(token)


@dataclasses.dataclass(frozen=True)
class PositionPart:
    """One factor of a named position, major to minor: a physical axis
    (``index`` None: ask ``lax.axis_index``) or a loop's traced step."""

    size: int
    physical: str | None = None
    index: object = None


def position_parts(names: Sequence, *, op: str) -> list[PositionPart]:
    """The factors of the position along logical ``names``, major to minor:
    for each name its mesh axes, then its loops' steps, then its vmap tile."""
    logical = _LOGICAL_AXES.get()
    note_named_op(names, op=op)
    parts: list[PositionPart] = []
    for name in names:
        axis = logical.get(name)
        if axis is None and not _bound_here(name):
            axis = _bindings_from_vmap_levels()[0].get(name)
        axis = axis or LogicalAxis(physical=(name,))
        physical = [PositionPart(physical_axis_size(n), physical=n) for n in axis.physical]
        steps = _LOOP_STEPS.get()
        for loop in axis.loops:
            if loop not in steps:
                raise NxopsError(f"{op}: named axis {name!r} runs on the serial loop "
                                 f"{loop.name!r}, which is not being traced here.")
        loops = [PositionPart(loop.length, index=steps[loop]) for loop in axis.loops]
        parts += physical[:-1] + loops + physical[-1:] if loops else physical
    return parts


# While an nx.xmap body is traced: a hint per logical name, from the named ops
# traced there, for the error of a result that varies along a name its out_axes
# omit (e.g. an einsum operand that omits a contracted name's group).
_VARIES_HINTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "nxops_varies_hints", default=None)


@contextlib.contextmanager
def logical_axes(mapping: dict[str, LogicalAxis]) -> Iterator[None]:
    """Binds logical names while an ``nx.xmap`` body is traced (nests: inner
    bindings extend outer ones)."""
    token = _LOGICAL_AXES.set({**_LOGICAL_AXES.get(), **mapping})
    hints = _VARIES_HINTS.set({})
    try:
        yield
    finally:
        _VARIES_HINTS.reset(hints)
        _LOGICAL_AXES.reset(token)


def note_varies_hint(name, text: str) -> None:
    """Records why a value may vary along logical ``name`` (the first note per name)."""
    hints = _VARIES_HINTS.get()
    if hints is not None:
        hints.setdefault(name, text)


def varies_hint(name) -> str:
    """The note for ``name`` recorded in the body being traced ("" if none)."""
    return (_VARIES_HINTS.get() or {}).get(name, "")


@dataclasses.dataclass
class CustomCall:
    """One custom_jvp/custom_vjp call (``kind``) bound in an nx.xmap body: the
    logical names bound there; the first named op over mesh axes its primal function
    (or ``fwd``) ran, as ``(op, name, mesh axes)``; and, set by xmap once it
    knows which mesh axes the call's operands and results vary along,
    ``typed_bwd(bwd, args, mesh_axes)``: ``bwd`` called with cotangents as
    under no resources (``xmap/_custom_rules.py``)."""

    kind: str
    bound: dict
    vmap_sizes: dict   # the bound names' vmap levels: {physical name: size}
    primal_mesh_op: tuple | None = None
    typed_bwd: Callable | None = None

    def unbound_now(self) -> frozenset:
        """The names bound at the call that are not bound the same way now (a
        ``bwd`` traced for a ``jax.grad`` taken outside their xmap), also those
        an enclosing custom rule found so (JAX nests the rules of a call
        batched by a vmap level, or re-bound from a jaxpr, in the outer call's)."""
        now = _LOGICAL_AXES.get()
        return _UNBOUND_AT_RULE.get() | {n for n, axis in self.bound.items() if now.get(n) != axis}

    def mesh_axes_of(self, names) -> tuple:
        """The manual mesh axes that carry ``names`` (as bound at the call)."""
        manual = manual_mesh_axes()
        return tuple(dict.fromkeys(p for n in sorted(names) for p in self.bound[n].physical
                                   if p in manual))


# The names the running custom rules found unbound when they were entered.
_UNBOUND_AT_RULE: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "nxops_unbound_at_rule", default=frozenset())
# The custom call whose primal function (or fwd) is running, if any.
_PRIMAL_OF: contextvars.ContextVar[CustomCall | None] = contextvars.ContextVar(
    "nxops_primal_of", default=None)
# While xmap traces a program over mesh axes: the custom calls bound (None: nobody watches).
_CUSTOM_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "nxops_custom_calls", default=None)


@contextlib.contextmanager
def _collecting(var: contextvars.ContextVar) -> Iterator[list]:
    """Yields a list that ``var`` holds within the block (and fills)."""
    items: list = []
    token = var.set(items)
    try:
        yield items
    finally:
        var.reset(token)


def collect_custom_calls() -> contextlib.AbstractContextManager[list]:
    """Yields a list that fills with the CustomCalls bound within the block."""
    return _collecting(_CUSTOM_CALLS)


def _with_names_bound_at_call(kind: str) -> list | None:
    """Wrappers for the functions of a custom_jvp/custom_vjp called in an
    nx.xmap body, which run them with the logical names bound where it was
    called. JAX traces ``bwd`` (and a ``jvp`` rule, under an outer grad)
    lazily, when it transposes the program, after xmap's context is gone; a
    name carried by mesh axes alone would be unbound there. None
    outside xmap."""
    bound = _LOGICAL_AXES.get()
    if not bound:
        return None
    env = _core.get_axis_env()
    vmap_sizes = {p: env.axis_size(p) for axis in bound.values() for p in axis.physical
                  if env.axis_exists(p)}
    call = CustomCall(kind, dict(bound), vmap_sizes)
    if _CUSTOM_CALLS.get() is not None:
        _CUSTOM_CALLS.get().append(call)

    def with_names(role: str) -> Callable:
        def rule_with_names(rule, *args):
            unbound = call.unbound_now()
            mesh_axes = call.mesh_axes_of(unbound) if role == "bwd" else ()
            typed = bool(mesh_axes) and call.typed_bwd is not None
            tokens = (_UNBOUND_AT_RULE.set(frozenset() if typed else unbound),
                      _PRIMAL_OF.set(call if role == "primal" else None),
                      _LOGICAL_AXES.set({**_LOGICAL_AXES.get(), **bound}))
            env = _core.get_axis_env()
            missing = {p: n for p, n in call.vmap_sizes.items() if not env.axis_exists(p)}
            try:
                with _bound_axis_sizes(missing):
                    return _run_rule(call, rule, args, typed, mesh_axes)
            finally:
                _LOGICAL_AXES.reset(tokens[2])
                _PRIMAL_OF.reset(tokens[1])
                _UNBOUND_AT_RULE.reset(tokens[0])
        rule_with_names.custom_call = call
        return rule_with_names
    roles = ("primal", "jvp") if kind == "custom_jvp" else ("primal", "primal", "bwd")
    return [with_names(role) for role in roles]


def _run_rule(call: CustomCall, rule: Callable, args, typed: bool, mesh_axes: tuple):
    if typed:   # cotangents converted here: the rules inside see them as typed
        return call.typed_bwd(rule, args, mesh_axes)
    if mesh_axes and call.primal_mesh_op is not None:
        raise _untyped_bwd_error(call.primal_mesh_op)
    return rule(*args)


def _untyped_bwd_error(mesh_op: tuple) -> NxopsError:
    op, name, mesh_axes = mesh_op
    return NxopsError(
        f"A jax.custom_vjp called in the xmapped function runs {op} over {name!r}, which "
        f"axis_resources maps to mesh axes {mesh_axes}, and jax.grad is taken outside the "
        f"xmap, but nxops could not tell which of its operands and results vary along "
        f"{name!r} (the body did not trace to one jaxpr), so its bwd cannot be given the "
        f"cotangents it gets with no resources. Take jax.grad inside the xmapped function, "
        f"or map {name!r} to no resources.")


def unbound_in_running_rule(name) -> bool:
    """Whether a custom rule of a call in an nx.xmap body is running with the
    logical ``name`` no longer bound as it was at the call: a ``bwd`` traced
    for a ``jax.grad`` taken outside the xmap (whose ``shard_map`` then sums
    a replicated operand's cotangent over the mesh axes itself)."""
    return name in _UNBOUND_AT_RULE.get()


# While an nx.xmap body is traced: the names its named ops use (None: nobody
# watches, or a nested xmap's body, whose names are its own).
_NAMES_USED: contextvars.ContextVar[set | None] = contextvars.ContextVar(
    "nxops_names_used", default=None)


@contextlib.contextmanager
def names_used(watch: bool) -> Iterator[set]:
    """Yields a set that fills with the names the named ops (collectives,
    position and size queries) traced within the block use, if ``watch``;
    an enclosing block does not see those of this one."""
    used: set = set()
    token = _NAMES_USED.set(used if watch else None)
    try:
        yield used
    finally:
        _NAMES_USED.reset(token)


def note_named_op(names: Sequence, *, op: str) -> None:
    """Records the names a named op uses (``names_used``), and a named op over
    mesh axes run by a custom call's primal function."""
    used = _NAMES_USED.get()
    if used is not None:
        used.update(names)
    call = _PRIMAL_OF.get()
    if call is None or call.primal_mesh_op is not None:
        return
    for name in names:
        if name in call.bound:
            mesh_axes = call.mesh_axes_of((name,))
            if mesh_axes:
                call.primal_mesh_op = (op, name, mesh_axes)
                return


_wrap_custom_rules(_with_names_bound_at_call)


class TileAxisName(str):
    """The axis name of an ``nx.xmap`` vmap level: equal to, and hashing as,
    the plain name (JAX and raw ``lax`` collectives see the usual string),
    and carrying the logical names bound where the level was made.

    A ``custom_jvp``/``custom_vjp`` rule is traced lazily, when an outer
    ``jax.grad``/``jvp`` needs it, after the xmap's context is gone; JAX then
    re-enters the rule's vmap levels, and the names come back from them
    (:func:`_bindings_from_vmap_levels`)."""

    logical: dict

    def __new__(cls, name: str, logical: dict[str, LogicalAxis]):
        self = super().__new__(cls, name)
        self.logical = logical
        return self

    def __reduce__(self):   # pickles (and copies) as the plain name
        return (str, (str(self),))


def _bindings_from_vmap_levels() -> tuple[dict[str, LogicalAxis], dict]:
    """(logical names, physical vmap sizes) recovered from the vmap levels on
    the trace stack: used only where the context has no binding for a name."""
    levels = _enclosing_batch_axes()
    logical: dict[str, LogicalAxis] = {}
    for name, _ in reversed(levels):   # outer levels first: inner ones extend them
        logical.update(getattr(name, "logical", {}))
    return logical, {name: size for name, size in levels}


def current_logical_axes() -> dict[str, LogicalAxis]:
    return dict(_LOGICAL_AXES.get())


# The bound logical names, uncopied: a new object whenever they change. A
# bound C method, not a function: every xmap call reads it.
current_logical_axes_map: Callable[[], dict[str, LogicalAxis]] = _LOGICAL_AXES.get


def as_name_tuple(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def refuse_nested(axis, *, op: str) -> None:
    """An axis argument is one flat tuple of ints and names: a tuple inside it
    would otherwise be looked up as a name ("not bound here")."""
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    nested = next((item for item in items if isinstance(item, (tuple, list))), None)
    if nested is not None:
        flat = tuple(j for i in items for j in (i if isinstance(i, (tuple, list)) else (i,)))
        raise NxopsError(f"{op}: the axes {axis!r} nest the tuple {nested!r}; axes are one flat "
                         f"tuple of ints (positional) and names, not tuples of tuples. For "
                         f"these axes write {flat!r}.")


def resolve(names: Sequence, *, op: str, allow_loop: bool = False) -> tuple[str, ...]:
    """Physical axis names (major to minor) for logical ``names``."""
    logical = _LOGICAL_AXES.get()
    physical: list[str] = []
    for name in names:
        axis = logical.get(name)
        if axis is None and not _bound_here(name):
            axis = _bindings_from_vmap_levels()[0].get(name)
        if axis is None:
            physical.append(name)
            continue
        if axis.loops and not allow_loop:
            raise NxopsError(
                f"{op} over named axis {name!r}, which nx.xmap maps to the serial loop "
                f"{axis.loops[0].name!r}: each loop step sees one chunk, so {op} across the "
                f"loop is not possible. {looped_name_hint(name, op)}")
        physical.extend(axis.physical)
    note_named_op(names, op=op)
    return tuple(physical)


# The jnp reduction that does outside an xmap what a named reduction does inside.
_OUTSIDE_REDUCTIONS = {"mean": "jnp.mean", "sum": "jnp.sum", "max": "jnp.max", "min": "jnp.min",
                       "prod": "jnp.prod", "logsumexp": "jax.nn.logsumexp"}


def looped_name_hint(name, op: str) -> str:
    """How to reduce over a name on a serial loop, where no collective can
    (``op``: e.g. "nx.mean" or "jax.lax.pmean")."""
    base = op.rsplit(".", 1)[-1]   # "pmean" reduces like "mean"
    outside = _OUTSIDE_REDUCTIONS.get(base) or _OUTSIDE_REDUCTIONS.get(base.removeprefix("p"))
    how = (f"{outside}(result, axis=<the dimension of {name!r}>)" if outside
           else "jnp operations on that dimension")
    return (f"To reduce over {name!r}, keep {name!r} in the value's out_axes and reduce the "
            f"xmap's result outside it ({how}; jax.grad of that works too), or map {name!r} "
            f"to mesh axes (or nothing) instead of a loop in axis_resources.")


def _bound_here(name) -> bool:
    return _core.get_axis_env().axis_exists(name) or name in manual_mesh_axes()


def bound_here(names: Sequence) -> bool:
    """Whether the axis environment binds every physical name (it does not in
    a lazily traced custom_jvp/custom_vjp rule: see TileAxisName)."""
    return all(map(_bound_here, names))


def manual_mesh_axes() -> frozenset:
    """Mesh axes that are manual here (inside ``shard_map``)."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def split_vmap_and_mesh(physical: Sequence[str], *, op: str,
                        positional_hint: str = "use an int for a positional axis",
                        ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Splits physical names into (vmap names, manual mesh names).

    Raises NxopsError for a name that no enclosing vmap, shard_map or xmap
    binds, ending with ``positional_hint``: how to say it positionally.
    """
    env = _core.get_axis_env()
    manual = manual_mesh_axes()
    vmap_names, mesh_names = [], []
    for name in physical:
        if name in manual:
            mesh_names.append(name)
        elif env.axis_exists(name) or name in _bindings_from_vmap_levels()[1]:
            vmap_names.append(name)
        else:
            bound = user_visible_axis_names(env.axis_sizes)
            close = difflib.get_close_matches(str(name), bound, n=1)
            raise NxopsError(
                f"{op}: axis name {name!r} is not bound here (bound names: "
                f"{', '.join(bound) or 'none'}).{f' Did you mean {close[0]!r}?' if close else ''}"
                f" Named axes exist inside nx.xmap, "
                f"jax.vmap(..., axis_name=...) and jax.shard_map bodies; {positional_hint}.")
    return tuple(vmap_names), tuple(mesh_names)


def user_visible_axis_names(bound_axes) -> list[str]:
    """The names a user may pass to an op here, for messages: xmap's logical
    names, mesh axes and the user's own vmap/shard_map names; not the
    physical names nx.xmap makes up for its local vmap tiles."""
    logical = _LOGICAL_AXES.get()
    mesh_axes = set(jax.sharding.get_abstract_mesh().axis_names)
    made_up = {p for axis in logical.values() for p in axis.physical
               if p not in logical and p not in mesh_axes}
    visible = {n for n in (*bound_axes, *logical)
               if n not in made_up and not isinstance(n, InternalAxisName)}
    return sorted(map(str, visible))


def physical_axis_size(name: str) -> int:
    env = _core.get_axis_env()
    if not env.axis_exists(name):   # a lazily traced custom_jvp/vjp rule: see TileAxisName
        sizes = _bindings_from_vmap_levels()[1]
        if name in sizes:
            return sizes[name]
    return env.axis_size(name)


def check_no_duplicates(names: Sequence, *, op: str, what: str) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise NxopsError(f"{op}: {what} {names!r} names axis {name!r} twice; name it once.")
        seen.add(name)


# ---------------------------------------------------------------------------
# Helpers of the ops in every layer


def physical_parts(axis_name, op: str, *, allow_loop=False):
    """``(physical, vmap_names, mesh_names)`` of a user's ``axis_name`` for
    ``nx.<op>``: every physical axis, and the vmapped and mesh ones when the
    name is laid out mesh axes first (else both empty: the op then runs
    JAX's own collective over ``physical``)."""
    refuse_nested(axis_name, op=f"nx.{op}")
    names = as_name_tuple(axis_name)
    for n in names:
        if isinstance(n, int):
            raise NxopsError(f"nx.{op}: axis_name {axis_name!r} must name axes, not positions.")
    physical = resolve(names, op=f"nx.{op}", allow_loop=allow_loop)
    vmap_names, mesh_names = split_vmap_and_mesh(physical, op=f"nx.{op}")
    if vmap_names and mesh_names and physical != mesh_names + vmap_names:
        # Mixed names in minor-mesh order: fall back to JAX's own collective.
        return physical, (), ()
    return physical, vmap_names, mesh_names


def one_or_tuple(names: tuple):
    """One name as itself, several as the tuple (how lax takes axis names)."""
    return names if len(names) > 1 else names[0]


def check_not_size_0(name, size: int, op: str) -> None:
    if size == 0:
        raise NxopsError(
            f"nx.{op} over {name!r}, a named axis of size 0: there are no positions to "
            f"split the value among (a tile of 1/0 of it is undefined). Skip the op when "
            f"the axis is empty, or give {name!r} a size of at least 1.")


def mesh_platform() -> str:
    """Lowering platform (cpu, cuda, rocm, tpu) of the devices the collective
    runs on: the one `explain` traces for, else the concrete mesh's devices',
    else the default devices'."""
    if _reports.target_platform() is not None:
        return _reports.target_platform()
    devices = getattr(_mesh.get_concrete_mesh(), "devices", None)
    first = devices.flat[0] if devices is not None and devices.size else None
    device = first if isinstance(first, jax.Device) else jax.devices()[0]
    if device.platform == "gpu":  # JAX names CUDA and ROCm devices "gpu"
        return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
    return device.platform
