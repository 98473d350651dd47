"""Random named programs and their positional twins.

A program is a chain of ops applied to ``x`` (each position holds a (4,)
vector; the named axis has 8 positions) with a second input ``y`` and a PRNG
key. Every op has a named form (nxops, inside the xmap body, over the axis
called ``name``) and a positional reference written here with jax.numpy on the
global (8, 4) arrays, never calling nxops. Ops keep the per-position shape
(4,), so any chain is a valid program.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import nxops as nx

N = 8                                   # positions along the named axis
W8 = jnp.arange(N, dtype=jnp.float32) / N   # weights that fold a gathered axis back
CLOSED_KEY = jax.random.key(42)         # a key closed over by the body
CYCLE = [(i, (i + 1) % N) for i in range(N)]
PARTIAL = [(0, 1), (1, 2), (5, 3)]


@dataclasses.dataclass(frozen=True)
class Op:
    named: Callable     # (x, y, key, name) -> x'  inside the body
    positional: Callable  # (X, Y, key) -> X'      on global arrays
    collective: bool    # communicates along the name (refused over a serial loop)


def _positions_keyed(key, fn):
    return jnp.stack([fn(jax.random.fold_in(key, i)) for i in range(N)])


def _outer_rows(X, Y):
    """[q, p, :] = X[q] * Y[p]: what position q holds after gathering x and
    exchanging rows (kept unsimplified so inf/NaN propagate as in the program)."""
    return X[:, None, :] * Y[None, :, :]


def _np_partial_permute(X):
    out = jnp.zeros_like(X)
    for src, dst in PARTIAL:
        out = out.at[dst].set(X[src])
    return out


OPS: dict[str, Op] = {
    # elementwise (no communication)
    "sin": Op(lambda x, y, k, n: jnp.sin(x), lambda X, Y, k: jnp.sin(X), False),
    "mul_y": Op(lambda x, y, k, n: x * y, lambda X, Y, k: X * Y, False),
    # named reductions, broadcast back against x
    "sum": Op(lambda x, y, k, n: x - nx.sum(x, n), lambda X, Y, k: X - X.sum(0), True),
    "max": Op(lambda x, y, k, n: x * nx.max(x, n), lambda X, Y, k: X * X.max(0), True),
    "min": Op(lambda x, y, k, n: x + nx.min(x, n), lambda X, Y, k: X + X.min(0), True),
    "mean": Op(lambda x, y, k, n: x * nx.mean(x, n), lambda X, Y, k: X * X.mean(0), True),
    "prod": Op(lambda x, y, k, n: x * nx.prod(x, n), lambda X, Y, k: X * X.prod(0), True),
    "logsumexp": Op(lambda x, y, k, n: x - nx.logsumexp(x, n),
                    lambda X, Y, k: X - jax.nn.logsumexp(X, 0), True),
    "sum_mixed": Op(lambda x, y, k, n: x * nx.sum(x, (0, n)),
                    lambda X, Y, k: X * X.sum(), True),
    # collectives over the name
    "psum": Op(lambda x, y, k, n: nx.psum(x * y, n) + x, lambda X, Y, k: (X * Y).sum(0) + X, True),
    "pmax": Op(lambda x, y, k, n: nx.pmax(x, n) - x, lambda X, Y, k: X.max(0) - X, True),
    "pmin": Op(lambda x, y, k, n: nx.pmin(x, n) * x, lambda X, Y, k: X.min(0) * X, True),
    "pmean": Op(lambda x, y, k, n: nx.pmean(x * y, n) + x, lambda X, Y, k: (X * Y).mean(0) + X,
                True),
    "einsum_angle": Op(lambda x, y, k, n: x * nx.einsum(f"<{n}>i,<{n}>i->", x, y),
                       lambda X, Y, k: X * (X * Y).sum(), True),
    "einsum_curly": Op(lambda x, y, k, n: nx.einsum(f"{{{n}}}i,{{{n}}}i->i", x, y) + x,
                       lambda X, Y, k: (X * Y).sum(0) + X, True),
    "einsum_three": Op(lambda x, y, k, n: nx.einsum(f"<{n}>i,<{n}>i,i->i", x, y, x) - x,
                       lambda X, Y, k: (X * Y).sum(0) * X - X, True),
    "pdot": Op(lambda x, y, k, n: x * nx.pdot(x, y, n, pos_contract=((0,), (0,))),
               lambda X, Y, k: X * (X * Y).sum(), True),
    "all_gather": Op(lambda x, y, k, n: W8 @ nx.all_gather(x, n) + x,
                     lambda X, Y, k: W8 @ X + X, True),
    "untile": Op(lambda x, y, k, n: W8 @ nx.untile(x[None], {n: 0}) + x,
                 lambda X, Y, k: W8 @ X + X, True),
    "psum_scatter": Op(lambda x, y, k, n: nx.psum_scatter(nx.all_gather(x, n) * y, n,
                                                           tiled=True)[0],
                       lambda X, Y, k: _outer_rows(X, Y).sum(1), True),
    "all_to_all": Op(lambda x, y, k, n: W8 @ nx.all_to_all(nx.all_gather(x, n) * y, n, 0, 0,
                                                           tiled=True),
                     lambda X, Y, k: (W8[None, :, None] * _outer_rows(X, Y)).sum(1), True),
    "all_to_all_negative": Op(lambda x, y, k, n: W8 @ nx.all_to_all(
        nx.all_gather(x, n) * y, n, -2, -2, tiled=True),
        lambda X, Y, k: (W8[None, :, None] * _outer_rows(X, Y)).sum(1), True),
    "ppermute_cycle": Op(lambda x, y, k, n: nx.ppermute(x, n, CYCLE),
                         lambda X, Y, k: jnp.roll(X, 1, axis=0), True),
    "ppermute_partial": Op(lambda x, y, k, n: nx.ppermute(x, n, PARTIAL) + y,
                           lambda X, Y, k: _np_partial_permute(X) + Y, True),
    # position queries (fine over serial loops: positions are global)
    "tile": Op(lambda x, y, k, n: x + nx.tile(jnp.arange(4.0 * N) / (4 * N), {n: 0}),
               lambda X, Y, k: X + jnp.arange(4.0 * N).reshape(N, 4) / (4 * N), False),
    "axis_index": Op(lambda x, y, k, n: x + nx.axis_index(n),
                     lambda X, Y, k: X + jnp.arange(N)[:, None], False),
    "axis_size": Op(lambda x, y, k, n: x * (nx.axis_size(n) / N) + nx.psum(1, n) / N,
                    lambda X, Y, k: X + 1.0, False),
    "one_hot": Op(lambda x, y, k, n: x * nx.one_hot(2, axis=n) + x,
                  lambda X, Y, k: X * (jnp.arange(N) == 2)[:, None] + X, False),
    "random_passed": Op(lambda x, y, k, n: x + nx.random.uniform(k, (4,), names=n),
                        lambda X, Y, k: X + _positions_keyed(k, lambda kk: jax.random.uniform(kk, (4,))),
                        False),
    "random_closed": Op(lambda x, y, k, n: x * jax.random.uniform(
        jax.random.fold_in(CLOSED_KEY, nx.axis_index(n)), (4,)),
        lambda X, Y, k: X * _positions_keyed(CLOSED_KEY, lambda kk: jax.random.uniform(kk, (4,))),
        False),
}

COLLECTIVE_OPS = sorted(n for n, op in OPS.items() if op.collective)
LOCAL_OPS = sorted(n for n, op in OPS.items() if not op.collective)


def named_program(ops: tuple[str, ...], name: str) -> Callable:
    def program(x, y, key):
        for op in ops:
            x = OPS[op].named(x, y, key, name)
        return x
    return program


def positional_program(ops: tuple[str, ...]) -> Callable:
    def program(X, Y, key):
        for op in ops:
            X = OPS[op].positional(X, Y, key)
        return X
    return program


def uses_collectives(ops: tuple[str, ...]) -> bool:
    return any(OPS[op].collective for op in ops)


def inputs(seed: int, nan: bool = False):
    rng = np.random.default_rng(seed)
    X = rng.uniform(0.5, 1.5, (N, 4)).astype(np.float32)
    Y = rng.uniform(-1.0, 1.0, (N, 4)).astype(np.float32)
    if nan:
        X[3, 1] = np.nan
        X[5, 2] = np.inf
    return jnp.asarray(X), jnp.asarray(Y), jax.random.key(seed)
