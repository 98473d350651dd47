"""Every private JAX API nxops uses, in one place.

nxops is tested on JAX 0.10.2 and 0.12.0.1 (CI; the GPU machines run 0.11.2).
A private API that moves breaks here and nowhere else: where JAX versions
differ, the entry picks by feature detection (what the module has), never by
version number. Each entry says what nxops uses it for and the public
alternative, if any. Modules import these names from here, never from
``jax._src``.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import weakref
from typing import Callable

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr

# Primitive machinery (ops/_primitive.py): the impl of a primitive through
# dispatch, abstract evaluation by tracing the reference, and the debug info
# that tracing wants. Public alternative: none for custom primitives with
# per-platform lowering rules (jax.extend.core.Primitive is the public part).
from jax._src import api_util, dispatch
from jax._src import linear_util as _lu
from jax._src.interpreters import partial_eval as pe
# core: ShapedArray without sharding/vma (kernels lower on plain avals),
# get_axis_env (which vmap/shard_map names are bound: ops/_axis_env.py),
# jaxprs_in_params (xmap's variance walk), trace_state_clean (is xmap called
# eagerly, outside any jit: xmap._mesh_calls.OffMesh). No public alternative.
from jax._src import core
# The lowering context's axis context: is an op auto-partitioned by XLA?
from jax._src import sharding_impls
# Config states: every NXOPS_* variable (_config.py) and the report epoch
# (kernels/_reports.py) as jit-key config and check_vma toggles. No public way to define
# states that are part of the jit cache key. nx.export also lowers symbolic
# shapes over a mesh with config.use_shardy_partitioner(False) when present
# (_export.py says why; getattr-detected, absent in a JAX without GSPMD).
from jax._src import config
# The concrete mesh of jax.set_mesh and the legacy `with mesh:` environment
# (xmap's mesh in scope). Public: jax.sharding.get_abstract_mesh only gives
# the abstract mesh.
from jax._src import mesh as mesh_lib
# What jax.set_mesh sets (JAX 0.10: jax._src.config; 0.11+: jax._src.mesh) and
# what the legacy `with mesh:` sets.
device_context = getattr(mesh_lib, "device_context", None) or config.device_context
legacy_mesh_context = config.mesh_context_manager
# Whether an argument is a committed jax.Array (xmap's input placement).
from jax._src.array import ArrayImpl
# vmap's out_axes inference sentinel (xmap's tile levels learn which results
# vary along a name). No public alternative.
from jax._src.interpreters.batching import infer as infer_out_axes
# Source locations in xmap's shared-resource error messages.
from jax._src import source_info_util
# Pallas interpret-mode effects of the TPU ring collectives.
from jax._src.pallas import core as pallas_core
# Traceback filtering: nxops registers its folder as internal and marks its
# public entry points as API boundaries, so tracebacks end at the user's line
# as they do for JAX's own frames (nxops/_traceback.py; Flax does the same).
# Public alternative: none (jax.config's jax_traceback_filtering only switches it).
from jax._src import traceback_util
# Effect types and the sets that allow them (the ring collectives' own
# ordered effect, accepted by jax.checkpoint). No public alternative.
from jax._src import effects

# One primitive lowered per platform where a module is lowered for several
# (jax.export for cpu+cuda+tpu): nxops' kernel primitives lower inline
# (uncacheable: a cached lowering becomes a function of its own, hiding each
# operand's producer from `auto`'s rule), and JAX 0.10's per-platform switch
# for uncacheable primitives fails (it concatenates a list with the context's
# tuple of result avals); ops/_primitive.py calls this switch itself with a
# list. None where it moved: the primitives then keep JAX's cached lowering
# and `auto` sees no producer (it keeps XLA). No public alternative.
try:
    from jax._src.interpreters.mlir import lower_per_platform
except ImportError:  # pragma: no cover - a JAX where it moved
    lower_per_platform = None


def vma_checked() -> bool:
    """Whether the enclosing ``shard_map`` body is traced with ``check_vma=True``.

    It decides how a replicated collective result transposes: under
    ``check_vma=True`` an invariant-typed all-gather transposes to a slice;
    under ``check_vma=False`` shard_map divides replicated cotangents by the
    mesh size and a varying all-gather must sum them back. No public API.
    """
    return bool(config._check_vma.value)


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies along (its type in a ``shard_map``
    body under ``check_vma=True``; empty elsewhere). The aval's field is
    ``manual_axis_type`` on JAX 0.10-0.12; no public accessor."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def varying_like(state, *operands):
    """``state`` (a pytree: a loop's initial carry, a cond's operand) cast to
    vary along every manual mesh axis that it or any of ``operands`` varies
    along. Under ``check_vma=True`` a loop's carry must keep its type and a
    cond's branches must agree, while a step that reads the operands varies
    along their axes: a carry that starts from a constant (zeros) would not.
    Outside a ``shard_map`` (or in a kernel lowered on plain avals) it is
    ``state`` unchanged. The cast transposes to a psum, as JAX's own implicit
    casts do."""
    axes = frozenset().union(*(varying_axes(x) for x in jax.tree_util.tree_leaves(operands)))

    def cast(x):
        missing = axes - varying_axes(x)
        return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x
    return jax.tree_util.tree_map(cast, state)


def vmap_names_collective():
    """A context in which to bind a ``lax`` collective whose axes are all vmap
    names. JAX's collectives first cast their operand to vary along their
    axes; inside a ``shard_map`` body under ``check_vma=True`` that cast
    asserts that each axis is a mesh axis, which a vmap name is not (and a
    vmap name has no varying type to give). The cast is off for the bind.
    No public alternative."""
    return config.auto_pcast(False)


def scan_split(params) -> tuple[int, int]:
    """(number of consts, number of carries) of a ``scan`` equation's operands.

    JAX 0.10 stores them as ``num_consts``/``num_carry``; 0.11+ as ``ft_in``, a
    flat tree (consts, carry, xs). No public alternative (jaxpr params).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def adapt_dce_rule(primitive) -> None:
    """Makes ``primitive``'s dead-code-elimination rule callable by this JAX.

    JAX <= 0.11 calls a rule as ``rule(used_outs, eqn)``; 0.12 as
    ``rule(used_outs, live_ins, eqn)``. A third-party rule written for the
    older signature (jax-triton 0.4.1's) is wrapped; nothing changes where the
    signatures agree. No public alternative (``pe.dce_rules`` is internal).
    """
    rule = pe.dce_rules.get(primitive)
    if rule is None or getattr(rule, "_nxops_adapted", False):
        return
    expected = len(inspect.signature(pe._default_dce_rule).parameters)
    try:
        given = len(inspect.signature(rule).parameters)
    except (TypeError, ValueError):
        return
    if (expected, given) == (3, 2):
        def adapted(used_outs, live_ins, eqn):
            del live_ins
            return rule(used_outs, eqn)
        adapted._nxops_adapted = True
        pe.dce_rules[primitive] = adapted


def enclosing_batch_axes() -> list[tuple[object, int]]:
    """``(name, size)`` of every vmap level on the trace stack, innermost first.

    When JAX traces a ``custom_jvp``/``custom_vjp`` rule lazily (an outer
    ``jax.grad`` of a jitted program), it re-enters the rule's vmap levels as
    traces but not the axis environment, so ``core.get_axis_env()`` does not
    know their names. Private: ``parent_trace`` and ``axis_data``; where they
    are missing this answers [] (the names stay unbound, as before).
    """
    found = []
    trace = getattr(core, "unsafe_get_current_trace", lambda: None)()
    while trace is not None:
        axis_data = getattr(trace, "axis_data", None)
        if axis_data is not None and getattr(axis_data, "name", None) is not None:
            found.append((axis_data.name, axis_data.size))
        trace = getattr(trace, "parent_trace", None)
    return found


def axis_index_at_vmap_level(name) -> object | None:
    """``lax.axis_index(name)`` computed at the trace of the vmap level named
    ``name`` (an iota there), or None where no such level is on the trace stack.

    A lazily traced ``custom_jvp``/``custom_vjp`` rule (see
    :func:`enclosing_batch_axes`) runs inside its vmap levels but not their
    axis environment: a ``lax.axis_index`` staged into a jaxpr there (a
    ``lax.cond``/``switch`` branch) is refused when that jaxpr is checked or
    transformed ("unbound axis name"). Made at the level, the index enters the
    branch as a closed-over value instead. Private: ``set_current_trace``,
    ``parent_trace`` and ``axis_data``.
    """
    set_trace = getattr(core, "set_current_trace", None)
    trace = getattr(core, "unsafe_get_current_trace", lambda: None)()
    while trace is not None and set_trace is not None:
        if getattr(getattr(trace, "axis_data", None), "name", None) == name:
            with set_trace(trace):
                return lax.axis_index(name)
        trace = getattr(trace, "parent_trace", None)
    return None


def type_constants_in_current_trace(aval_of: Callable) -> bool:
    """Makes the jaxpr trace in scope ask ``aval_of(value)`` for the type of
    each value it closes over from now on (None: the value's own type), for
    as long as that trace lives. False where the trace in scope is no jaxpr
    trace, or JAX's ``new_const`` takes no type (constants keep their own).

    xmap uses it for arrays made under an Explicit mesh and closed over by a
    body that runs in a shard_map over some of its axes: their own type names
    the all-Explicit mesh, which JAX refuses to mix with the body's partly
    Manual one (jax-ml/jax#29162: "pass it in as an argument" -- a closure is
    not an argument xmap can see). Typed as they are met, they need no trace
    of the body beforehand to find them. Private: ``DynamicJaxprTrace.new_const``
    (wrapped once, class-wide: a trace has slots) and ``new_const(aval=)``."""
    trace = getattr(core, "unsafe_get_current_trace", lambda: None)()
    if not isinstance(trace, pe.DynamicJaxprTrace) or not _hook_new_const():
        return False
    _CONSTANT_TYPES[trace] = aval_of
    return True


# jaxpr trace -> its ``aval_of`` (see type_constants_in_current_trace).
_CONSTANT_TYPES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def _hook_new_const() -> bool:
    """Wraps ``DynamicJaxprTrace.new_const`` (once) to ask a registered trace's
    ``aval_of``; other traces pay one check of an empty-or-small dictionary."""
    original = getattr(pe.DynamicJaxprTrace, "new_const", None)
    if original is None or "aval" not in inspect.signature(original).parameters:
        return False

    def new_const(self, c, source_info, aval=None):
        if aval is None and _CONSTANT_TYPES:
            aval_of = _CONSTANT_TYPES.get(self)
            if aval_of is not None:   # (a constant the trace already holds keeps its type)
                aval = aval_of(c)
        return original(self, c, source_info, aval)

    for name in ("new_const", "pure", "lift"):
        if getattr(pe.DynamicJaxprTrace, name, None) is original:
            setattr(pe.DynamicJaxprTrace, name, new_const)
    return True


def spmd_axis_names() -> frozenset:
    """The mesh axes of the enclosing ``jax.vmap(..., spmd_axis_name=...)`` s
    (empty outside them). xmap's shard_map makes them manual too: JAX 0.10's
    shard_map batching rule fails on an spmd axis the shard_map leaves automatic.
    No public API; ``frozenset()`` where the axis env lacks it."""
    return frozenset(getattr(core.get_axis_env(), "spmd_axis_names", None) or ())





def wrap_custom_rules(wrap) -> None:
    """Runs the functions of every later ``custom_jvp``/``custom_vjp`` call
    through wrappers, made as the call is bound: ``wrap(kind)`` gives None or
    one ``wrapper(fun, *args)`` per function, ``kind`` being ``"custom_jvp"``
    (the primal function and the ``jvp`` rule) or ``"custom_vjp"`` (the primal
    function, ``fwd`` and ``bwd``); each function takes and returns flat lists.

    xmap uses it so that a rule JAX traces lazily (an outer ``jax.grad`` traces
    ``bwd`` only when it transposes the program, after xmap's context is gone)
    re-enters the logical names bound where the rule was called. Private:
    ``bind_with_trace`` of the two call primitives, and ``WrappedFun.wrap``
    (a transformation that keeps JAX's own stores of the functions, which it
    resets when it traces ``fwd`` again). No public alternative; where the primitives
    lack that method, nothing is wrapped (a rule then finds its names from
    xmap's vmap levels only).
    """
    from jax._src import custom_derivatives, linear_util as lu

    for kind, primitive in (("custom_jvp", custom_derivatives.custom_jvp_call_p),
                            ("custom_vjp", custom_derivatives.custom_vjp_call_p)):
        bind_with_trace = getattr(type(primitive), "bind_with_trace", None)
        if bind_with_trace is None or "bind_with_trace" in vars(primitive):
            continue

        def hooked(trace, args, avals, params, /, _bind=bind_with_trace, _p=primitive, _kind=kind):
            subfuns = params.get("subfuns")
            wrappers = None if subfuns is None else wrap(_kind)
            if wrappers is not None:
                subfuns = tuple(f.wrap(_through, (w,), None) if isinstance(f, lu.WrappedFun)
                                else _WrappedRule(f, w) for f, w in zip(subfuns, wrappers))
                params = {**params, "subfuns": subfuns}
            outs = _bind(_p, trace, args, avals, params)
            _note_staged_rules(trace, outs, subfuns)
            return outs

        primitive.bind_with_trace = hooked


def _through(fun, wrapper, *args):
    return wrapper(fun, *args)


class _WrappedRule:
    """A rule JAX passes as a plain callable (a ``bwd`` re-bound from a
    jaxpr), run through its wrapper."""

    def __init__(self, rule, wrapper):
        self.rule, self.wrapper = rule, wrapper

    def __call__(self, *args):
        return self.wrapper(self.rule, *args)


def custom_rule_wrappers(fun) -> list:
    """The wrappers ``wrap_custom_rules`` put around a custom call's function
    (a ``bwd`` in a ``custom_vjp_call`` equation's params), outermost first."""
    if isinstance(fun, _WrappedRule):
        return [fun.wrapper] + custom_rule_wrappers(fun.rule)
    return [static[0] for gen, static in getattr(fun, "transforms", ()) if gen is _through]

def bwd_cotangents(out) -> tuple[list, Callable]:
    """The cotangents a custom_vjp's flat ``bwd`` returned (one per operand),
    and a function that puts changed ones back in its return value. JAX 0.10
    returns the list; 0.12 a pair (the list, its backward-pass logs)."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list):
        return list(out[0]), lambda cts: (cts, out[1])
    return list(out), lambda cts: cts


def bound_axis_sizes(sizes: dict):
    """A context that binds the vmap axis names ``{name: size}`` in JAX's axis
    environment, as ``jax.vmap`` does while it traces its function. xmap's
    custom rules re-enter the names of the vmap levels where they were called:
    JAX traces a lazily traced rule's nested custom functions on a fresh trace
    that sees neither the levels nor their axis environment. Private:
    ``core.extend_axis_env_nd``; where it is missing, nothing is bound."""
    import contextlib
    extend = getattr(core, "extend_axis_env_nd", None)
    return extend(list(sizes.items())) if extend is not None and sizes else contextlib.nullcontext()


# Nested jax.jit calls kept whole while xmap stages a body that it then
# evaluates again (``stage_to_evaluate``). JAX inlines an ``inline=True`` jit
# (every jax.numpy function) into the jaxpr being staged; evaluated again
# under jax.grad, each inlined equation is then linearized on its own. Kept
# as a call, it is linearized once per jaxpr (JAX caches that per jaxpr, as
# for the code the body runs without xmap) and inlined where it is evaluated:
# the staged program is the one the body gives traced directly.
# Private: pjit's jit_p and its staging rule; without them jits are inlined.
_KEEP_JIT_CALLS = contextvars.ContextVar("nxops_keep_jit_calls", default=False)
try:
    from jax._src.pjit import jit_p as _jit_p
    _inlining_jit_rule = pe.custom_staging_rules.get(_jit_p)
except ImportError:  # pragma: no cover - a JAX where it moved
    _jit_p = _inlining_jit_rule = None


def _jit_staging_rule(trace, source_info, *args, **params):
    consts = params["jaxpr"].consts
    if (_KEEP_JIT_CALLS.get() and not params.get("compiler_options_kvs")
            and not (consts and any(isinstance(c, core.Ref) for c in consts))):
        return trace.default_process_primitive(_jit_p, args, params, source_info=source_info)
    return _inlining_jit_rule(trace, source_info, *args, **params)


if _inlining_jit_rule is not None:
    pe.custom_staging_rules[_jit_p] = _jit_staging_rule


# The custom_jvp/custom_vjp calls of a jaxpr that ``stage_to_evaluate``
# staged, evaluated with the rules they were bound with. JAX stages a call
# with its primal function traced and its ``jvp`` (or ``fwd``) rule kept for
# later, as a thunk that traces the rule to a jaxpr when a transformation
# asks; bound again from the jaxpr (``get_bind_params``), the rule is then
# traced to a jaxpr and that jaxpr evaluated, twice the work of calling it.
# Bound with the rule itself, the transformation calls it once, as for the
# body traced directly. A call whose primal function closed over values of
# the trace (constants of its equation) keeps JAX's thunk, which takes them.
# Private: ``WrappedFun.stores`` (reset before a rule is called again, as
# JAX's thunk does) and the staged tracer's variable (``.val``); where the
# tracer has none, calls are bound from the jaxpr as before.
class _Staging:
    """The trace ``stage_to_evaluate`` stages into, and the functions of the
    custom calls bound on it, by the variable of each call's first result."""

    def __init__(self):
        self.trace = None
        self.rules: dict = {}


_STAGING: contextvars.ContextVar = contextvars.ContextVar("nxops_staging", default=None)
_STAGED_RULES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # jaxpr -> rules


def _note_staged_rules(trace, outs, subfuns) -> None:
    staging = _STAGING.get()
    if (staging is not None and trace is staging.trace and subfuns is not None and outs
            and isinstance(outs[0], pe.DynamicJaxprTracer)):
        var = getattr(outs[0], "val", None)
        if isinstance(var, core.Var):
            staging.rules[var] = subfuns


def stage_to_evaluate(fun: Callable, *args):
    """``jax.make_jaxpr(fun)(*args)`` for a jaxpr that ``eval_closed_jaxpr``
    evaluates again where it runs: nested jits stay calls, custom calls keep
    their rules (see above). It traces straight to a jaxpr: make_jaxpr goes
    through a jax.jit of ``fun``, whose set-up (signature checks, the jit's
    own cache) costs about as much as tracing a small function. ``fun``
    returns a flat list of arrays. Private: partial_eval's
    trace_to_jaxpr_dynamic and linear_util's wrap_init; public alternative:
    jax.make_jaxpr (slower)."""
    flat, tree = jax.tree.flatten(args)
    staging = _Staging()

    def flat_fun(*leaves):
        staging.trace = core.trace_ctx.trace
        return fun(*jax.tree.unflatten(tree, leaves))
    tokens = _KEEP_JIT_CALLS.set(True), _STAGING.set(staging)
    try:
        jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
            _lu.wrap_init(flat_fun, debug_info=_staged_debug_info(len(flat))),
            [jax.typeof(x) for x in flat])
    finally:
        _STAGING.reset(tokens[1])
        _KEEP_JIT_CALLS.reset(tokens[0])
    closed = ClosedJaxpr(jaxpr, consts)
    if staging.rules:   # (JAX 0.12's ClosedJaxpr is a new Jaxpr: its .jaxpr is itself)
        _STAGED_RULES[closed.jaxpr] = staging.rules
    return closed


@functools.lru_cache(maxsize=None)
def _staged_debug_info(n_args: int):
    """The debug info of a ``stage_to_evaluate`` trace of ``n_args`` leaves:
    the same for every function it stages (a ``*leaves`` function of this
    module; the jaxpr is evaluated, so no name in it reaches a program), so
    made once per count, not from the function's signature at every trace."""
    def flat_fun(*leaves):
        del leaves
    return api_util.debug_info("nx.xmap", flat_fun, [0] * n_args, {})   # (None would be no leaf)


def eval_closed_jaxpr(closed, *args) -> list:
    """``closed`` (a ClosedJaxpr) evaluated on ``args`` in the trace in
    scope: each equation bound again, custom_jvp/custom_vjp calls with their
    rules (how xmap reuses the one trace of a body)."""
    return eval_closed_jaxpr_with(closed, None, *args)


def eval_closed_jaxpr_with(closed, override: Callable | None, *args) -> list:
    """``eval_closed_jaxpr``, where ``override(eqn, operands)`` may give an
    equation's results (a list) instead of binding it again (None: bind it).
    Each equation is bound as JAX's own ``core.eval_jaxpr`` binds it (its
    source info, name stack and context), but a custom call staged by
    ``stage_to_evaluate`` with its own rule; values are not dropped as they
    die (they are tracers: xmap evaluates inside a trace). Private:
    ``source_info_util.user_context``, ``eqn.ctx`` and
    ``Primitive.get_bind_params``, as ``core.eval_jaxpr`` uses them."""
    jaxpr = closed.jaxpr
    rules = _STAGED_RULES.get(jaxpr)
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    literal = core.Literal
    for eqn in jaxpr.eqns:
        operands = [v.val if isinstance(v, literal) else env[v] for v in eqn.invars]
        outs = None if override is None else override(eqn, operands)
        if outs is None:
            staged = rules.get(eqn.outvars[0]) if rules and eqn.outvars else None
            params = (eqn.primitive.get_bind_params(eqn.params) if staged is None
                      else _with_staged_rule(eqn, staged))
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
                  eqn.ctx.manager):
                outs = eqn.primitive.bind(*operands, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [v.val if isinstance(v, literal) else env[v] for v in jaxpr.outvars]


def _with_staged_rule(eqn, staged: tuple) -> dict:
    """The parameters that bind the custom call ``eqn`` again: JAX's, but
    with its own ``jvp`` or ``fwd`` rule (``staged``: the functions it was
    bound with) where it was staged without constants (see above)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    rule = staged[1]   # custom_jvp: (fun, jvp); custom_vjp: (fun, fwd, bwd)
    if eqn.params.get("num_consts") or not isinstance(rule, _lu.WrappedFun):
        return params
    for store in rule.stores:
        if store:
            store.reset()
    fun, _, *rest = params["subfuns"]
    return {**params, "subfuns": (fun, rule, *rest)}


def staging_into_jaxpr() -> bool:
    """Whether the trace in scope stages into a jaxpr (jax.jit, a lax control
    flow body, make_jaxpr), directly or under transformations (jax.grad,
    jax.vmap): not an eager transformation, whose ops run as they come."""
    trace = core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False
