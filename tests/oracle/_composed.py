"""Composed named programs for the oracle: chains of named ops inside
control-flow, remat and custom-derivative wrappers, in every dtype, at named
sizes 8, 1 and 0 and positional sizes 4, 1 and 0.

Each op and wrapper is written once against an ops module ``M``: ``NX``
(nxops) for the program under test, or ``tests/oracle/_reference.py`` (no
nxops: jax.lax.all_gather and jax.numpy inside ``jax.vmap(axis_name=...)``)
for the positional reference. A program is ``(ops, wrappers, dtype, branch)``
and maps a per-position ``x`` of shape (D,) to the same shape and dtype, with
a per-position ``y``, a replicated ``w`` of shape (N*D,) and a PRNG key.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import nxops as nx
from tests._megatron import fg_operators
from tests._sequence_parallel import sequence_parallel_operators

CLOSED_KEY = jax.random.key(42)     # a key closed over by the body


def _nx_inner_map(fn, xs, name, resources):
    return nx.xmap(fn, [[name, ...]], [name, ...], axis_resources=resources)(xs)


def _nx_custom_rules(name, inside_grad):
    del inside_grad      # nxops means them the same inside and outside a gradient
    f, g = fg_operators(nx.psum, name)
    return {**sequence_parallel_operators(nx, name), "f": f, "g": g}


NX = types.SimpleNamespace(
    fg=lambda name, inside_grad: fg_operators(nx.psum, name),
    custom_rules=_nx_custom_rules,
    **{op: getattr(nx, op) for op in (
        "sum", "max", "min", "mean", "prod", "logsumexp", "psum", "pmax", "pmin", "pmean",
        "einsum", "pdot", "all_gather", "untile", "tile", "psum_scatter", "all_to_all",
        "ppermute", "axis_index", "axis_size", "one_hot", "random")},
    inner_map=_nx_inner_map)

# ---------------------------------------------------------------- dtypes
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16,
          "c64": jnp.complex64, "i32": jnp.int32, "bool": jnp.bool_}
KIND = {"f32": "f", "bf16": "f", "f16": "f", "c64": "c", "i32": "i", "bool": "b"}
DIFFERENTIABLE = {"f32", "bf16", "f16", "c64"}
TOLERANCE = {"f32": 2e-4, "c64": 2e-4, "f16": 2e-2, "bf16": 8e-2, "i32": 0, "bool": 0}


def _weights(n, dtype):
    """Weights that fold a gathered axis back, distinguishing the positions."""
    i = jnp.arange(n)
    kind = jnp.dtype(dtype).kind
    if kind == "b":
        return i % 3 == 0
    if kind in "iu":
        return (i - 3).astype(dtype)
    if kind == "c":
        return (i * (1 + 0.5j) / max(n, 1)).astype(dtype)
    return (i / max(n, 1)).astype(dtype)


def _wsum(G):
    return jnp.tensordot(_weights(G.shape[0], G.dtype), G, 1)


def _sub(a, b):
    return a ^ b if a.dtype == jnp.bool_ else a - b


def _position_value(i, dtype):
    return i % 2 == 1 if dtype == jnp.bool_ else jnp.asarray(i).astype(dtype)


def _cycle(n):
    return [(i, (i + 1) % n) for i in range(n)]


def _partial(n):
    return [(s, d) for s, d in [(0, 1), (1, 2), (5, 3)] if s < n and d < n]


def _flip(x):
    return x[::-1]


# ---------------------------------------------------------------- ops
@dataclasses.dataclass(frozen=True)
class Op:
    kinds: str            # dtype kinds it takes: f(loat) c(omplex) i(nt) b(ool)
    collective: bool      # communicates along the name (refused over a serial loop)
    fn: Callable          # (x, y, w, key, name, M) -> x'


def _op(kinds, collective):
    return lambda fn: Op(kinds, collective, fn)


OPS: dict[str, Op] = {
    # local
    "sin": Op("fc", False, lambda x, y, w, k, n, M: jnp.sin(x)),
    "mul_y": Op("fcib", False, lambda x, y, w, k, n, M: x * y),
    "mul_w": Op("fcib", False, lambda x, y, w, k, n, M: x * w[:x.shape[0]]),
    # named reductions
    "sum": Op("fci", True, lambda x, y, w, k, n, M: x - M.sum(x, n)),
    "sum_bool": Op("b", True, lambda x, y, w, k, n, M: x ^ (M.sum(x, n) % 2 == 1)),
    "max": Op("fib", True, lambda x, y, w, k, n, M: x * M.max(x, n)),
    "min": Op("fib", True, lambda x, y, w, k, n, M: x + M.min(x, n)),
    "mean": Op("fc", True, lambda x, y, w, k, n, M: x * M.mean(x, n)),
    "prod": Op("fci", True, lambda x, y, w, k, n, M: x * M.prod(x, n)),
    "prod_zero": Op("f", True, lambda x, y, w, k, n, M: x * M.prod(
        x * (M.axis_index(n) != 0).astype(x.dtype), n)),          # a zero factor at position 0
    "logsumexp": Op("fc", True, lambda x, y, w, k, n, M: x - M.logsumexp(x, n)),
    "sum_mixed": Op("fci", True, lambda x, y, w, k, n, M: x * M.sum(x, (0, n))),
    # collectives
    "psum": Op("fci", True, lambda x, y, w, k, n, M: M.psum(x * y, n) + x),
    "pmax": Op("fib", True, lambda x, y, w, k, n, M: _sub(M.pmax(x, n), x)),
    "pmin": Op("fib", True, lambda x, y, w, k, n, M: M.pmin(x, n) * x),
    "pmean": Op("fc", True, lambda x, y, w, k, n, M: M.pmean(x * y, n) + x),
    "einsum_angle": Op("fcib", True, lambda x, y, w, k, n, M: x * M.einsum(
        f"<{n}>i,<{n}>i->", x, y)),
    "einsum_curly": Op("fcib", True, lambda x, y, w, k, n, M: M.einsum(
        f"{{{n}}}i,{{{n}}}i->i", x, y) + x),
    "einsum_three": Op("fcib", True, lambda x, y, w, k, n, M: _sub(M.einsum(
        f"<{n}>i,<{n}>i,i->i", x, y, x), x)),
    "pdot": Op("fcib", True, lambda x, y, w, k, n, M: x * M.pdot(
        x, y, n, pos_contract=((0,), (0,)))),
    "all_gather": Op("fcib", True, lambda x, y, w, k, n, M: _wsum(M.all_gather(x, n)) + x),
    "untile": Op("fcib", True, lambda x, y, w, k, n, M: _wsum(M.untile(x[None], {n: 0})) + x),
    "psum_scatter": Op("fci", True, lambda x, y, w, k, n, M: M.psum_scatter(
        M.all_gather(x, n) * y, n, tiled=True)[0]),
    "psum_scatter_bool": Op("b", True, lambda x, y, w, k, n, M: M.psum_scatter(
        M.all_gather(x, n) * y, n, tiled=True)[0] % 2 == 1),
    "all_to_all": Op("fcib", True, lambda x, y, w, k, n, M: _wsum(M.all_to_all(
        M.all_gather(x, n) * y, n, 0, 0, tiled=True))),
    "all_to_all_negative": Op("fcib", True, lambda x, y, w, k, n, M: _wsum(M.all_to_all(
        M.all_gather(x, n) * y, n, -2, -2, tiled=True))),
    "all_to_all_replicated": Op("fcib", True, lambda x, y, w, k, n, M: x + _wsum(M.all_to_all(
        w.reshape(M.axis_size(n), -1), n, 0, 0, tiled=True))),   # w does not vary along n
    "ppermute_cycle": Op("fcib", True, lambda x, y, w, k, n, M: M.ppermute(
        x, n, _cycle(M.axis_size(n)))),
    "ppermute_partial": Op("fcib", True, lambda x, y, w, k, n, M: M.ppermute(
        x, n, _partial(M.axis_size(n))) + y),
    # position queries
    "tile_w": Op("fcib", False, lambda x, y, w, k, n, M: x + M.tile(w, {n: 0})),
    "axis_index": Op("fcib", False, lambda x, y, w, k, n, M: x + _position_value(
        M.axis_index(n), x.dtype)),
    "axis_size": Op("fcib", False, lambda x, y, w, k, n, M: x + _position_value(
        M.axis_size(n) - M.psum(1, n) + 1, x.dtype)),
    "one_hot": Op("fcib", False, lambda x, y, w, k, n, M: x + M.one_hot(2, axis=n).astype(
        x.dtype)),
    "random_passed": Op("f", False, lambda x, y, w, k, n, M: x + M.random.uniform(
        k, x.shape, names=n).astype(x.dtype)),
    "random_closed": Op("f", False, lambda x, y, w, k, n, M: x * jax.random.uniform(
        jax.random.fold_in(CLOSED_KEY, M.axis_index(n)), x.shape).astype(x.dtype)),
}
# max and min of no positions are errors (jnp: ValueError; nxops: NxopsError)
NO_IDENTITY = {"max", "min", "pmax", "pmin"}
# tile and the tiled scatters have no chunk size when the name has no positions
NO_ZERO_SIZE = {"tile_w", "psum_scatter", "psum_scatter_bool", "all_to_all",
                "all_to_all_negative", "all_to_all_replicated"}


# Custom rules over each collective (tests/_sequence_parallel.py, and
# Megatron's f/g) as ops: ``M.rule(kind, name)`` is the custom_vjp (see
# build). Drawn only by draw_rule_programs, so that the other draws stay as
# they were. Each keeps the per-position shape (D,) and takes an operand that
# varies along the name.
RULE_OPS: dict[str, Op] = {
    "rule_gather": Op("fc", True, lambda x, y, w, k, n, M: x + _wsum(M.rule("gather", n)(x[None]))),
    "rule_scatter": Op("fc", True, lambda x, y, w, k, n, M: M.rule("scatter", n)(
        M.all_gather(x, n) * y)[0]),
    "rule_all_to_all": Op("fc", True, lambda x, y, w, k, n, M: _wsum(M.rule("all_to_all", n)(
        M.all_gather(x, n) * y).reshape(-1, x.shape[0]))),
    "rule_ring": Op("fc", True, lambda x, y, w, k, n, M: M.rule("ring", n)(x) + y),
    "rule_untile": Op("fc", True, lambda x, y, w, k, n, M: x + _wsum(M.rule("untile", n)(x[None]))),
    "rule_fg": Op("fc", True, lambda x, y, w, k, n, M: M.rule("g", n)(M.rule("f", n)(x) * y) + x),
}
OPS.update(RULE_OPS)
NO_ZERO_SIZE |= {"rule_scatter", "rule_all_to_all"}


# ---------------------------------------------------------------- wrappers
@dataclasses.dataclass(frozen=True)
class Ctx:
    name: str
    M: object
    branch: int                 # a per-program constant for uniform cond/switch
    inner_resources: dict
    inside_grad: bool = False   # the body is differentiated inside (M.fg needs to know)


def _uniform_int(ctx, value):
    """A traced int that is the same at every position (a collective of a constant)."""
    return ctx.M.psum(jnp.int32(value), ctx.name)


def _custom_jvp(g, x, w, e, ctx):
    f = jax.custom_jvp(g)
    f.defjvp(lambda primals, tangents: jax.jvp(g, primals, tangents))
    return f(x, w, e)


def _custom_vjp(g, x, w, e, ctx):
    # everything the body uses is an argument: a bwd closing over the forward's
    # tracers would leak them
    f = jax.custom_vjp(g)
    f.defvjp(lambda x, w, e: (g(x, w, e), (x, w, e)),
             lambda res, ct: jax.vjp(lambda x, w: g(x, w, res[2]), *res[:2])[1](ct) + (None,))
    return f(x, w, e)


def _megatron_fg(g, x, w, e, ctx):
    """Tensor parallelism as GPT-J writes it: f on the replicated ``w`` (its
    cotangent is summed over the name), g's psum of a per-position value (whose
    cotangent passes back unchanged). docs/xmap.md: "Custom rules with named
    collectives"."""
    f, g_psum = ctx.M.fg(ctx.name, ctx.inside_grad)
    out = g(x, f(w), e)
    return out + g_psum(out * e[0])


def _linear_solve(g, x, w, e, ctx):
    solve = lambda matvec, rhs: rhs / 2 + 0.125 * ctx.M.psum(rhs, ctx.name)   # linear, named
    return lax.custom_linear_solve(lambda t: 2 * t, g(x, w, e), solve, symmetric=True)


def _nested(g, x, w, e, ctx):
    out = ctx.M.inner_map(lambda v: g(v, w, e), jnp.stack([x, _flip(x)]), "m",
                          ctx.inner_resources)
    return out[0] + out[1]


def _checkpoint_names(g, x, w, e, ctx):
    from jax.ad_checkpoint import checkpoint_name
    return jax.checkpoint(lambda x, w, e: g(checkpoint_name(x * 1, "oracle_x"), w, e),
                          policy=jax.checkpoint_policies.save_only_these_names("oracle_x"))(x, w, e)


def _checkpoint(**kw):
    return lambda g, x, w, e, c: jax.checkpoint(g, **kw)(x, w, e)


def _while(cond):
    def wrap(g, x, w, e, ctx):
        return lax.while_loop(lambda s: cond(s[0], ctx), lambda s: (s[0] + 1, g(s[1], w, e)),
                              (jnp.int32(0), x))[1]
    return wrap


def _map(g, x, w, e, c):
    out = lax.map(lambda v: g(v, w, e), jnp.stack([x, _flip(x)]))
    return out[0] + out[1]


_P = jax.checkpoint_policies
WRAPPERS: dict[str, Callable] = {     # (g, x, w, e, ctx) -> g applied around x; e = (y, key)
    "plain": lambda g, x, w, e, c: g(x, w, e),
    "scan": lambda g, x, w, e, c: lax.scan(lambda v, _: (g(v, w, e), None), x, None,
                                           length=2)[0],
    "fori": lambda g, x, w, e, c: lax.fori_loop(0, 2, lambda i, v: g(v, w, e), x),
    "fori_traced_bound": lambda g, x, w, e, c: lax.fori_loop(
        0, jnp.minimum(_uniform_int(c, 1), 2), lambda i, v: g(v, w, e), x),
    "while": _while(lambda i, c: i < 2),
    "while_collective_pred": _while(lambda i, c: (i < 2) & (c.M.psum(i, c.name) >= 0)),
    "while_per_position": _while(lambda i, c: i < c.M.axis_index(c.name) % 2 + 1),
    "cond": lambda g, x, w, e, c: lax.cond(_uniform_int(c, c.branch % 2) > 0,
                                           lambda v: g(v, w, e), _flip, x),
    "cond_per_position": lambda g, x, w, e, c: lax.cond(
        c.M.axis_index(c.name) % 2 == 0, lambda v: g(v, w, e), _flip, x),
    "switch": lambda g, x, w, e, c: lax.switch(
        _uniform_int(c, c.branch) % 3,
        [_flip, lambda v: g(v, w, e), lambda v: g(_flip(v), w, e)], x),
    "switch_per_position": lambda g, x, w, e, c: lax.switch(
        c.M.axis_index(c.name) % 3, [_flip, lambda v: g(v, w, e), lambda v: g(_flip(v), w, e)], x),
    "map": _map,
    "checkpoint": _checkpoint(),
    "checkpoint_nothing_saveable": _checkpoint(policy=_P.nothing_saveable),
    "checkpoint_dots_saveable": _checkpoint(policy=_P.dots_saveable),
    "checkpoint_everything_saveable": _checkpoint(policy=_P.everything_saveable,
                                                  prevent_cse=False),
    "checkpoint_names": _checkpoint_names,
    "custom_jvp": _custom_jvp,
    "custom_vjp": _custom_vjp,
    "linear_solve": _linear_solve,
    "megatron_fg": _megatron_fg,
    "nested_xmap": _nested,
}
PER_POSITION_BRANCHES = {"cond_per_position", "switch_per_position"}
REVERSE_MODE_UNSUPPORTED = {"while", "while_collective_pred", "while_per_position",
                            "fori_traced_bound"}      # JAX: no grad of a while loop
FORWARD_MODE_UNSUPPORTED = {"custom_vjp", "megatron_fg"}   # JAX: no jvp of a custom_vjp
FLOAT_ONLY_WRAPPERS = {"linear_solve", "megatron_fg"}
# Drawn only where asked for (draw_programs' must_use), so that the other
# draws stay as they were: the oracle's cases and CI time do not move.
OPT_IN_WRAPPERS = {"megatron_fg"}
# JAX: remat of complex values under grad fails (reduce_precision takes floats only)
REAL_ONLY_WRAPPERS = {w for w in WRAPPERS if w.startswith("checkpoint")}


@dataclasses.dataclass(frozen=True)
class Program:
    ops: tuple[str, ...]
    wrappers: tuple[str, ...]     # outermost first
    dtype: str
    branch: int

    def __str__(self):
        return f"{'∘'.join(self.wrappers)}[{','.join(self.ops)}]:{self.dtype}"

    @property
    def custom_rules(self):
        return bool(set(self.ops) & set(RULE_OPS))

    @property
    def collective(self):
        return any(OPS[o].collective for o in self.ops) or any(
            w in ("fori_traced_bound", "while_collective_pred", "cond", "switch", "linear_solve",
                  "megatron_fg")
            for w in self.wrappers)

    def transforms(self):
        """The transformations this program can take (JAX's own limits)."""
        out = ["forward"]
        jvp_of_custom_vjp = "custom_jvp" in self.wrappers and (self.custom_rules or (
            FORWARD_MODE_UNSUPPORTED & set(self.wrappers[self.wrappers.index("custom_jvp") + 1:])))
        # (its jvp rule would take it)
        if self.dtype in DIFFERENTIABLE and not jvp_of_custom_vjp:
            if not REVERSE_MODE_UNSUPPORTED & set(self.wrappers):
                out += ["grad_inside"]
                if "custom_vjp" not in self.wrappers:   # JAX: the bwd of a custom_vjp under
                    out += ["grad_outside"]             # grad(vmap) loses the axis name
            if not FORWARD_MODE_UNSUPPORTED & set(self.wrappers) and not self.custom_rules:
                out += ["jvp"]         # with jacfwd
        return out


def build(program: Program, name: str, M, inner_resources=None,
          inside_grad: bool = False) -> Callable:
    """(x, y, w, key) -> x' for one position: the chain inside the wrappers."""
    ctx = Ctx(name, M, program.branch, inner_resources or {}, inside_grad)
    if program.custom_rules:
        M = _with_custom_rules(M, name, inside_grad)

    def chain(x, w, e):
        y, key = e
        for op in program.ops:
            x = OPS[op].fn(x, y, w, key, name, M)
        return x

    def run(x, y, w, key):
        g = chain
        for wrapper in reversed(program.wrappers):
            g = (lambda wrap, inner: lambda x, w, e: wrap(inner, x, w, e, ctx))(
                WRAPPERS[wrapper], g)
        return g(x, w, (y, key))
    return run


def _with_custom_rules(M, name, inside_grad):
    """``M`` with ``M.rule(kind, name)``: its custom rules over ``name``."""
    rules = M.custom_rules(name, inside_grad)
    attributes = {k: v for k, v in vars(M).items() if not k.startswith("__")}
    return types.SimpleNamespace(**attributes, rule=lambda kind, n: rules[kind])


def ops_for(dtype: str, named_size: int) -> list[str]:
    kind = KIND[dtype]
    return sorted(o for o, op in OPS.items()
                  if kind in op.kinds and not (named_size == 0 and o in NO_ZERO_SIZE)
                  and o not in RULE_OPS)


def wrappers_for(dtype: str) -> list[str]:
    return sorted(w for w in WRAPPERS
                  if not (w in FLOAT_ONLY_WRAPPERS and dtype not in DIFFERENTIABLE)
                  and not (w in REAL_ONLY_WRAPPERS and KIND[dtype] == "c")
                  and w not in OPT_IN_WRAPPERS)


def inputs(programs: list[Program], n: int, d: int, seed: int):
    """Per program: X, Y of shape (N, D) and W of shape (N*D,), plus tangents,
    cotangents and jacfwd directions for the differentiable ones."""
    rng = np.random.default_rng(seed)

    def draw(dtype, shape, low, high):
        kind = KIND[dtype]
        if kind == "b":
            return jnp.asarray(rng.integers(0, 2, shape).astype(bool))
        if kind == "i":
            return jnp.asarray(rng.integers(low * 3, high * 3 + 1, shape).astype(np.int32))
        v = rng.uniform(low, high, shape)
        if kind == "c":
            v = v + 1j * rng.uniform(-0.5, 0.5, shape)
        return jnp.asarray(v.astype(np.dtype(DTYPES[dtype])) if kind == "c" else v, DTYPES[dtype])

    data = types.SimpleNamespace(X=[], Y=[], W=[], TX=[], TW=[], CX=[], B=[], key=jax.random.key(seed))
    for p in programs:
        data.X.append(draw(p.dtype, (n, d), 0.5, 1.5) if KIND[p.dtype] not in "ib"
                      else draw(p.dtype, (n, d), -1, 1))
        data.Y.append(draw(p.dtype, (n, d), -1.0, 1.0))
        data.W.append(draw(p.dtype, (max(n, 1) * d,), -1.0, 1.0))   # w[:d] exists at n=0
        data.TX.append(draw(p.dtype, (n, d), -1.0, 1.0))
        data.TW.append(draw(p.dtype, (max(n, 1) * d,), -1.0, 1.0))
        data.CX.append(draw(p.dtype, (n, d), -1.0, 1.0))
        data.B.append(draw(p.dtype, (3, n, d), -1.0, 1.0))
    return data


def draw_programs(rng: np.random.Generator, count: int, n: int, dtypes: list[str],
                  wrappers: list[str] | None = None, ops: list[str] | None = None,
                  must_use: str | None = None) -> list[Program]:
    """``count`` programs: chains of 1-3 ops in 1-2 wrappers; dtypes, ops and
    wrappers cycle through shuffled pools so that each batch covers them.
    ``must_use``: a wrapper every program has (outermost or inner)."""
    programs: list[Program] = []
    dtype_pool, wrapper_pool, op_pools = [], [], {}
    viable = [t for t in dtypes if [o for o in ops_for(t, n) if ops is None or o in ops]
              and [w for w in wrappers_for(t) if wrappers is None or w in wrappers]]
    attempts = 0
    while viable and len(programs) < count and attempts < 50 * count:
        attempts += 1
        if not dtype_pool:
            dtype_pool = list(rng.permutation(viable))
        dtype = str(dtype_pool.pop())
        allowed_ops = [o for o in ops_for(dtype, n) if ops is None or o in ops]
        allowed_wrappers = [w for w in wrappers_for(dtype) if wrappers is None or w in wrappers]
        pool = op_pools.setdefault(dtype, [])
        length = int(rng.integers(1, 4))
        while len(pool) < length:
            pool += [str(o) for o in rng.permutation(allowed_ops)]
        chain, op_pools[dtype] = tuple(pool[:length]), pool[length:]
        if not wrapper_pool:
            wrapper_pool = [str(w) for w in rng.permutation(sorted(set(WRAPPERS) - OPT_IN_WRAPPERS))]
        first = wrapper_pool.pop()
        if first not in allowed_wrappers:
            first = str(rng.choice(allowed_wrappers))
        others = [w for w in allowed_wrappers if w not in ("plain", first)]   # nested_xmap twice
        # would shadow its own inner name
        chosen = (first,) if rng.random() < 0.7 or first == "plain" or not others else (
            first, str(rng.choice(others)))
        if must_use is not None:
            chosen = (must_use,) if first == "plain" else (
                (must_use, first) if rng.random() < 0.5 else (first, must_use))
        program = Program(chain, chosen, dtype, int(rng.integers(0, 3)))
        if program not in programs:
            programs.append(program)
    return programs


def draw_rule_programs(rng: np.random.Generator, count: int, n: int,
                       dtypes: list[str]) -> list[Program]:
    """``count`` programs that each apply one custom rule (cycling through
    RULE_OPS) among 0-2 other ops, in 1-2 wrappers (cycling through those
    that a gradient can go through: custom_jvp's jvp rule cannot take a
    custom_vjp, nor reverse mode a while loop; and not a cond or switch whose
    branch differs per position, around which JAX 0.10's derivative of a
    collective under jax.vmap, the reference, is not the derivative of the
    program: tests/oracle/test_oracle_custom_rules.py)."""
    programs: list[Program] = []
    rule_pool, wrapper_pool = [], []
    for i in range(count):
        dtype = dtypes[i % len(dtypes)]
        if not rule_pool:
            rule_pool = [str(r) for r in rng.permutation(sorted(RULE_OPS))]
        # (in 16-bit floats, rounding decides which element an extremum's
        # gradient goes to: the reference's and nxops' may differ)
        pool = [o for o in ops_for(dtype, n) if not (dtype in ("bf16", "f16") and o in NO_IDENTITY)]
        others = [str(o) for o in rng.choice(pool, int(rng.integers(0, 3)))]
        chain = list(others)
        chain.insert(int(rng.integers(0, len(chain) + 1)), rule_pool.pop())
        allowed = [w for w in wrappers_for(dtype)
                   if w not in REVERSE_MODE_UNSUPPORTED | PER_POSITION_BRANCHES
                   and w != "custom_jvp"]
        if not wrapper_pool:
            wrapper_pool = [str(w) for w in rng.permutation(allowed)]
        first = wrapper_pool.pop()
        if first not in allowed:      # the pool is of another dtype's wrappers
            first = str(rng.choice(allowed))
        inner = [w for w in allowed if w not in ("plain", first)]
        wrappers = (first,) if rng.random() < 0.7 or first == "plain" else (
            first, str(rng.choice(inner)))
        programs.append(Program(tuple(chain), wrappers, dtype, int(rng.integers(0, 3))))
    return programs
