"""Which logical names each value of an xmap body varies along.

Two names mapped to one resource (``axis_resources={'a': 'x', 'b': 'x'}``)
split their values along it in lockstep: device (or loop step) ``i`` holds
chunk ``i`` of ``a`` *and* chunk ``i`` of ``b``. A value that varies along
both (``u * v`` with ``u`` along ``a`` and ``v`` along ``b``) would need every
pair of chunks, so each device would compute only the diagonal blocks; a
collective over ``b`` of a value varying along ``a`` would likewise mix the
chunks of ``a``. Both silently give wrong results, so the plan checks for
them once, when it is made: the body is traced to a jaxpr with each logical
name bound as a plain named axis, and the set of names every value varies
along is propagated through it (names only, no data).

Only plans where two names share a resource pay for this trace. Every plan
over mesh axes walks the jaxpr of its program's one trace instead, in mesh
axes (``_custom_rules.walk_program``): a name carried by mesh axes alone runs
without a vmap level (``_program.py``), so no ``vmap`` reports whether a
result varies along it; the walk does, so that a result whose ``out_axes``
omit such a name and that varies along it is still an error. The same walk
refuses a ``lax.while_loop`` whose predicate varies along mesh axes with a
collective across them inside: the devices would run different trip counts
and the collective deadlock (XLA:CPU aborts after a rendezvous timeout; GPUs
and TPUs hang).
"""
from __future__ import annotations

import itertools
import os
import weakref
from typing import Any, Callable, Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from nxops._jax import core, scan_split, source_info_util
from nxops._errors import NxopsError
from nxops.ops._axis_env import LogicalAxis, logical_axes
from nxops.ops._named_params import named_axes_effect
from nxops.xmap._plan import Plan, show_resource
from nxops.xmap._specs import AxisSpec

Names = frozenset
NO_NAMES: Names = Names()

# lax collectives: the parameter naming their axes, and whether the result
# still varies along them ("keep") or not ("drop").
_LAX_COLLECTIVES = {
    "psum": ("axes", "drop"), "pmax": ("axes", "drop"), "pmin": ("axes", "drop"),
    "psum_invariant": ("axes", "drop"),
    "all_gather": ("axis_name", "drop"), "all_gather_invariant": ("axis_name", "drop"),
    "reduce_scatter": ("axis_name", "keep"), "all_to_all": ("axis_name", "keep"),
    "ppermute": ("axis_name", "keep"),
}


def shared_resources(plan: Plan) -> dict[frozenset, Any]:
    """``{frozenset({a, b}): resource}`` for each pair of names sharing one."""
    shared = {}
    for a, b in itertools.combinations(plan.axes, 2):
        common = [r for r in a.resources if r in b.resources]
        if common:
            shared[frozenset((a.name, b.name))] = common[0]
    return shared


def analyse_shared(body: Callable, plan: Plan, in_tree, flat_args: Sequence,
                   flat_specs: Sequence[AxisSpec]) -> list[Names] | None:
    """The names each flattened result of ``body`` varies along, for a plan
    where two names share a resource (None, without tracing, for any other).

    Raises NxopsError if a value varies along two names that share a resource,
    or a collective over one of them takes a value varying along the other.
    Also None when the body does not trace on one instance with the names
    bound as plain axes (e.g. it calls ``lax.psum`` over a mesh axis): the
    program's own trace then reports any error."""
    shared = shared_resources(plan)
    if not shared:
        return None
    try:
        jaxpr = _trace_per_instance(body, plan, in_tree, flat_args, flat_specs)
    except Exception:  # a use of the names, or the body's own error
        # An error in the body itself: the program's own trace, which comes
        # next, reports it (with the real resources bound).
        return None
    logical = {a.vmap_name: a.name for a in plan.axes}
    mesh_axes = {a.name: a.mesh_axes for a in plan.axes if a.mesh_axes}
    analysis = VaryingWalk(logical, shared, mesh_axes)
    variance = analysis.run(jaxpr.jaxpr, [Names(s.axis_names) for s in flat_specs])
    # None: every name then gets a vmap level, under which such a cond's
    # index is batched, and JAX runs every branch on every device (a select).
    # A custom rule needs no level: a lazily traced one re-enters the names
    # bound where it was called (_axis_env.CustomCall).
    return None if analysis.branches_per_device else variance


def runs_without(body: Callable, plan: Plan, names: Sequence[str], in_tree,
                 flat_args: Sequence, flat_specs: Sequence[AxisSpec]) -> bool:
    """Whether ``body`` traces on one instance with ``names`` unbound, so that
    nothing in it (a collective, a position or size query, a named op) uses
    them. False when it fails for any reason, and when it holds a custom rule
    whose JVP/VJP JAX traces only later (under an outer grad), which may."""
    try:
        jaxpr = _trace_per_instance(body, plan, in_tree, flat_args, flat_specs, unbound=names)
    except Exception:  # the caller re-raises the program's own error
        return False
    return not any(eqn.primitive.name in _CUSTOM_RULE_PRIMITIVES
                   for eqn in _all_eqns([jaxpr.jaxpr]))


def _all_eqns(jaxprs: list[Jaxpr]):
    """Every equation of ``jaxprs`` and of the jaxprs nested in them."""
    for jaxpr in jaxprs:
        for eqn in jaxpr.eqns:
            yield eqn
            yield from _all_eqns(_sub_jaxprs(eqn))


def closed_over_constants(body: Callable, plan: Plan, in_tree, flat_args: Sequence,
                          flat_specs: Sequence[AxisSpec]) -> list:
    """The values ``body`` closes over (its jaxpr's constants; [] if it fails)."""
    try:
        return list(_trace_per_instance(body, plan, in_tree, flat_args, flat_specs).consts)
    except Exception:
        return []


def _trace_per_instance(body, plan: Plan, in_tree, flat_args, flat_specs,
                        unbound: Sequence[str] = ()) -> ClosedJaxpr:
    """The body's jaxpr on one instance's avals (named dims removed), with each
    name (but those ``unbound``) bound as the plain axis ``vmap_name`` of the
    name's full size."""
    avals = []
    for x, spec in zip(flat_args, flat_specs):
        aval = jax.typeof(x)
        named = spec.mapping
        shape = tuple(d for i, d in enumerate(aval.shape) if i not in named)
        avals.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
    bound = [a for a in plan.axes if a.name not in unbound]
    env = {a.name: LogicalAxis(physical=(a.vmap_name,)) for a in bound}
    flat_body = lambda *flat: body(*jax.tree.unflatten(in_tree, flat))
    with logical_axes(env):
        axis_env = [(a.vmap_name, a.size) for a in bound]
        return jax.make_jaxpr(flat_body, axis_env=axis_env)(*avals)


# custom_vjp_call_jaxpr: the name before JAX 0.5
_CUSTOM_RULE_PRIMITIVES = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}


class VaryingWalk:
    """Propagates, equation by equation, the logical names each variable of a
    jaxpr varies along; ``ResourceChecks`` raises at the first pair sharing a
    resource and at a loop whose trip count varies across a collective."""

    def __init__(self, logical: dict, shared: dict[frozenset, Any],
                 mesh_axes: dict[str, tuple[str, ...]] | None = None,
                 on_custom_vjp: Callable | None = None, shown: dict | None = None):
        self._checks = ResourceChecks(logical, shared, mesh_axes or {}, shown or {})
        self._names, self._check = self._checks.names, self._checks.check
        self._shared = shared
        # Called with (eqn, operand names, result names) at each custom_vjp call.
        self._on_custom_vjp = on_custom_vjp
        # Set when a cond/switch whose index varies along a name on mesh axes
        # holds a collective across those axes: without a vmap level the
        # devices would take different branches, and the collective deadlock.
        self.branches_per_device = False

    def run(self, jaxpr: Jaxpr, in_names: Sequence[Names],
            const_names: Names = NO_NAMES, record: dict | None = None) -> list[Names]:
        """The names each output of ``jaxpr`` varies along, given its inputs'.
        ``record``: filled with the names of every variable of ``jaxpr``
        (not of the jaxprs nested in it)."""
        env: dict = {} if record is None else record
        for var, names in zip(jaxpr.invars, in_names):
            env[var] = names
        for var in jaxpr.constvars:
            env[var] = const_names
        read = lambda v: Names() if isinstance(v, Literal) else env[v]
        for eqn in jaxpr.eqns:
            outs = self._eqn(eqn, [read(v) for v in eqn.invars])
            for var, names in zip(eqn.outvars, outs):
                self._check(names, eqn)
                env[var] = names
        return [read(v) for v in jaxpr.outvars]

    # -- one equation ------------------------------------------------------

    def _eqn(self, eqn, ins: list[Names]) -> list[Names]:
        name, params = eqn.primitive.name, eqn.params
        n_out = len(eqn.outvars)
        named = named_axes_effect(eqn.primitive, params)
        if name in _LAX_COLLECTIVES:
            param, effect = _LAX_COLLECTIVES[name]
            axes = self._names(params[param])
            for names in ins:
                self._check(names | axes, eqn, axes)
            if len(ins) == n_out:   # psum & co. take several operands, one per result
                return [n - axes if effect == "drop" else n | axes for n in ins]
            union = Names().union(*ins)
            return [union - axes if effect == "drop" else union | axes] * n_out
        if name == "axis_index":
            return [self._names(params["axis_name"])] * n_out
        if named is not None:   # nxops primitives: names in params (ops/_named_params.py)
            axes, drops = self._names(named[0]), named[1]
            union = Names().union(*ins)
            self._check(union | axes, eqn, axes)
            return [union - axes if drops else union | axes] * n_out
        if name == "scan":
            return self._scan(eqn, ins)
        if name == "while":
            return self._while(eqn, ins)
        if name == "cond":
            return self._cond(eqn, ins)
        if name in _CUSTOM_RULE_PRIMITIVES:
            outs = self._eqn_with_sub_jaxprs(eqn, ins)
            if self._on_custom_vjp is not None and name != "custom_jvp_call":
                self._on_custom_vjp(eqn, ins, outs)
            return outs
        return self._eqn_with_sub_jaxprs(eqn, ins)

    def _eqn_with_sub_jaxprs(self, eqn, ins: list[Names]) -> list[Names]:
        n_out = len(eqn.outvars)
        sub = _sub_jaxprs(eqn)
        if len(sub) == 1 and len(sub[0].invars) == len(ins) and len(sub[0].outvars) == n_out:
            deps = None if self._shared else _dependencies(sub[0])
            if deps is not None:   # (a jax.numpy function's jit, mostly)
                return [Names().union(*(ins[i] for i in d)) for d in deps]
            return self.run(sub[0], ins)   # jit, checkpoint, custom_jvp/vjp, shard_map, ...
        if sub:
            return self._unaligned(sub, ins, n_out)
        # Any other primitive: results vary along everything its operands vary along.
        return [Names().union(*ins)] * n_out

    def _unaligned(self, subs: list[Jaxpr], ins: list[Names], n_out: int) -> list[Names]:
        """Sub-jaxprs whose inputs do not line up one to one with the equation's
        operands (custom_linear_solve's matvec and solve, custom_root, pallas_call,
        any primitive this walk does not know): each is walked with every input
        varying along everything the operands (and, for loops inside, the
        sub-jaxprs' results) vary along, so no collective inside goes unchecked;
        the results vary along all of it."""
        names = Names().union(*ins)
        while True:   # grows monotonically: a fixed point within len(names) steps
            outs = [self.run(sub, [names] * len(sub.invars), names) for sub in subs]
            grown = names.union(*(o for per_sub in outs for o in per_sub))
            if grown == names:
                return [names] * n_out
            names = grown

    def _scan(self, eqn, ins):
        body = open_jaxpr(eqn.params["jaxpr"])
        n_consts, n_carry = scan_split(eqn.params)
        consts, carry = ins[:n_consts], ins[n_consts:n_consts + n_carry]
        xs = ins[n_consts + n_carry:]
        while True:   # the carry grows monotonically: a fixed point within len(names) steps
            outs = self.run(body, consts + carry + xs)
            new_carry = [c | o for c, o in zip(carry, outs[:n_carry])]
            if new_carry == carry:
                return carry + outs[n_carry:]
            carry = new_carry

    def _while(self, eqn, ins):
        p = eqn.params
        cond, body = open_jaxpr(p["cond_jaxpr"]), open_jaxpr(p["body_jaxpr"])
        n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts = ins[:n_cond], ins[n_cond:n_cond + n_body]
        carry = ins[n_cond + n_body:]
        while True:
            # A predicate varying along a name makes the trip count, so every
            # carry, vary along it.
            (pred,) = self.run(cond, cond_consts + carry)
            outs = self.run(body, body_consts + carry)
            new_carry = [c | o | pred for c, o in zip(carry, outs)]
            if new_carry == carry:
                self._checks.check_trip_count(pred, [cond, body], eqn)
                return carry
            carry = new_carry

    def _cond(self, eqn, ins):
        index, operands = ins[0], ins[1:]
        branches = [open_jaxpr(branch) for branch in eqn.params["branches"]]
        results = [self.run(branch, operands) for branch in branches]
        if self._checks.collective_spans_mesh_axes_of(index, branches):
            self.branches_per_device = True
        return [index.union(*per_branch) for per_branch in zip(*results)]


class ResourceChecks:
    """What a ``VaryingWalk`` checks against the plan: no value varies along
    two names that share a resource, and no collective spans mesh axes along
    which a loop's trip count (or a branch taken) varies."""

    def __init__(self, logical: dict, shared: dict[frozenset, Any],
                 mesh_axes: dict[str, tuple[str, ...]], shown: dict):
        self._logical = logical   # physical (vmap) name -> logical name
        self._shared = shared
        self._mesh_axes = mesh_axes   # logical name -> its mesh axes (if any)
        # A walk in mesh axes names them in its errors by the plan's names:
        # mesh axis -> (logical name, that name's mesh axes).
        self._shown = shown

    def names(self, axes: Any) -> Names:
        """The logical names of this plan among physical ``axes`` (a name or a tuple)."""
        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
        return Names(self._logical[a] for a in axes if a in self._logical)

    def check(self, names: Names, eqn, over: Names = NO_NAMES) -> None:
        """``names``: what a result of ``eqn`` varies along, or, for a collective
        ``over`` some names, those plus what its operand varies along."""
        if len(names) < 2:
            return
        for pair, resource in self._shared.items():
            if pair <= names:
                a, b = sorted(pair, key=lambda n: (n not in over, n))
                if a in over:
                    what = (f"{eqn.primitive.name} over {a!r} takes a value that varies "
                            f"along {b!r}")
                else:
                    what = f"{eqn.primitive.name} gives a value that varies along both"
                raise NxopsError(
                    f"Axes {a!r} and {b!r} are both mapped to the resource "
                    f"{show_resource(resource)}, but in the xmapped function {what}"
                    f"{_where(eqn)}. Each device (or loop step) only holds matching "
                    f"chunks of {a!r} and {b!r}, so this would compute wrong results. Map "
                    f"one of them to other resources (other mesh axes, or none) in "
                    f"axis_resources (e.g. keep only {a!r} on {show_resource(resource)}).")

    def check_trip_count(self, pred: Names, jaxprs: list[Jaxpr], loop_eqn) -> None:
        """Devices along the mesh axes of the names ``pred`` varies along run
        different trip counts: no collective inside may span those axes."""
        varying = {m: n for n in pred for m in self._mesh_axes.get(n, ())}
        if not varying:
            return
        for eqn, names in self._collectives(jaxprs):
            spanned = [m for n in names for m in self._mesh_axes.get(n, ()) if m in varying]
            if spanned:
                name, name_axes = self._shown.get(varying[spanned[0]], (
                    varying[spanned[0]], self._mesh_axes[varying[spanned[0]]]))
                over = sorted({self._shown.get(n, (n,))[0] for n in names})
                raise NxopsError(
                    f"A lax.while_loop in the xmapped function{_where(loop_eqn)} has a "
                    f"predicate that varies along {name!r}, which axis_resources maps to mesh "
                    f"axes {name_axes}, and inside it {eqn.primitive.name} over "
                    f"{', '.join(map(repr, over))}{_where(eqn)} communicates across "
                    f"mesh axis {spanned[0]!r}. The devices along it would run different trip "
                    f"counts and the collective would deadlock (a hang on GPU/TPU, an abort "
                    f"on CPU). Make the trip count uniform (compute the predicate from values "
                    f"that do not vary along {name!r}, e.g. reduce it with nx.pmax over "
                    f"{name!r}), use lax.fori_loop with static bounds (a scan), or move the "
                    f"collective out of the loop.")

    def _collectives(self, jaxprs: list[Jaxpr]):
        """``(eqn, logical names it communicates over)`` for every collective
        in ``jaxprs`` and the jaxprs nested in them."""
        for jaxpr in jaxprs:
            for eqn in jaxpr.eqns:
                names = self._communicates_over(eqn)
                if names:
                    yield eqn, names
                yield from self._collectives([open_jaxpr(j) for j in core.jaxprs_in_params(eqn.params)])

    def _communicates_over(self, eqn) -> Names:
        if eqn.primitive.name in _LAX_COLLECTIVES:
            return self.names(eqn.params[_LAX_COLLECTIVES[eqn.primitive.name][0]])
        named = named_axes_effect(eqn.primitive, eqn.params)
        if named is None or eqn.params.get("kind") == "tile":   # a tile is local work
            return Names()
        return self.names(named[0])

    def collective_spans_mesh_axes_of(self, index: Names, branches: list[Jaxpr]) -> bool:
        """Whether a collective in ``branches`` spans mesh axes that ``index``
        (a cond's) varies along: devices there take different branches."""
        varying = {m for n in index for m in self._mesh_axes.get(n, ())}
        return bool(varying) and any(m in varying for _, names in self._collectives(branches)
                                     for n in names for m in self._mesh_axes.get(n, ()))


# jaxpr -> per output, the inputs it depends on (None: see _dependencies).
_DEPENDENCIES: "weakref.WeakKeyDictionary[Jaxpr, list | None]" = weakref.WeakKeyDictionary()


def _dependencies(jaxpr: Jaxpr) -> list[frozenset] | None:
    """Per output of ``jaxpr``, the indices of the inputs it depends on, when
    no equation in it is one the walk treats apart (a collective, a position
    query, a named op, a custom rule, control flow): each output then varies
    along what those inputs vary along. None otherwise. Cached per jaxpr: the
    jitted jax.numpy functions a body calls come back with the same jaxprs,
    in every body and every lowering."""
    try:
        return _DEPENDENCIES[jaxpr]
    except KeyError:
        pass
    except TypeError:   # not weak-referenceable
        return _compute_dependencies(jaxpr)
    deps = _DEPENDENCIES[jaxpr] = _compute_dependencies(jaxpr)
    return deps


def _compute_dependencies(jaxpr: Jaxpr) -> list[frozenset] | None:
    env: dict = {v: frozenset((i,)) for i, v in enumerate(jaxpr.invars)}
    read = lambda v: frozenset() if isinstance(v, Literal) else env.get(v, frozenset())
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if (name in _LAX_COLLECTIVES or name in _WALKED_APART
                or named_axes_effect(eqn.primitive, eqn.params) is not None):
            return None
        ins = [read(v) for v in eqn.invars]
        sub = _sub_jaxprs(eqn)
        if not sub:
            outs = [frozenset().union(*ins)] * len(eqn.outvars)
        elif (len(sub) == 1 and len(sub[0].invars) == len(ins)
              and len(sub[0].outvars) == len(eqn.outvars)):
            inner = _dependencies(sub[0])
            if inner is None:
                return None
            outs = [frozenset().union(*(ins[i] for i in d)) for d in inner]
        else:
            return None
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


# Equations VaryingWalk reads with rules of their own.
_WALKED_APART = {"axis_index", "scan", "while", "cond"} | {
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}


def _sub_jaxprs(eqn) -> list[Jaxpr]:
    """The jaxprs in an equation's params, opened: those ``core.jaxprs_in_params``
    finds (a value, or an entry of a tuple value), then those JAX 0.12's "hi"
    primitives (``call_hi_primitive``: custom_root) keep as attributes of the
    object in their params. One pass with no generator, and a jit (the
    jax.numpy functions a body calls) read at once: the walks ask it of every
    equation of a body, so its calls count in every lowering."""
    params = eqn.params
    if eqn.primitive.name == "jit":   # its one jaxpr (its mesh's attributes hold none)
        return [params["jaxpr"].jaxpr]
    found: list = []
    in_attributes: list = []
    for value in params.values():
        if isinstance(value, tuple):
            found += [open_jaxpr(v) for v in value if isinstance(v, (Jaxpr, ClosedJaxpr))]
        elif isinstance(value, (Jaxpr, ClosedJaxpr)):
            found.append(open_jaxpr(value))
        else:
            attributes = getattr(value, "__dict__", None)
            if attributes:
                in_attributes += [open_jaxpr(v) for v in attributes.values()
                                  if isinstance(v, (Jaxpr, ClosedJaxpr))]
    return found + in_attributes


def open_jaxpr(jaxpr: Jaxpr | ClosedJaxpr) -> Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


_NXOPS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _where(eqn) -> str:
    """`` (at file:line (function))``: the innermost user frame of ``eqn``
    outside JAX and nxops, if any."""
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        if not frame.file_name.startswith(_NXOPS_DIR):
            return f" (at {frame.file_name}:{frame.start_line} ({frame.function_name}))"
    return ""
