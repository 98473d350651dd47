"""A training step in nx.xmap against the same step written by hand with
``jax.shard_map``, side by side in one run.

The step is ``jax.jit(jax.value_and_grad(loss))`` of a Megatron-style block on
a (dp=2, mp=4) mesh: batch positions on ``dp``, a ``shard`` name on ``mp``,
column-parallel ``w1``, row-parallel ``w2`` with ``psum`` over the shards,
vocab logits, ``logsumexp`` cross-entropy and ``pmean`` over the batch. The
hand-written twin uses ``jax.shard_map`` over the mesh axes the placement
uses, ``jax.vmap(axis_name=)`` for a name left off the mesh, and lax
collectives. Placements: ``dp`` (batch on dp), ``mp`` (shard on mp),
``mixed`` (both).

- ``test_training_step``: one entry per implementation (group per
  placement), timed by pytest-benchmark (the twin is the baseline);
- ``test_training_step_interleaved``: each round calls both in ABBA order
  (which one goes first alternates), its ratio is the xmap calls' time over
  the twin's, and the median of the per-round ratios is recorded
  (``extra_info["ratio_median"]``): on a shared machine consecutive timings
  drift, and interleaving puts both under the same load (ABBA cancels a
  drift within the round).

Not in the ``quick`` subset (about 4 minutes on this project's loaded CPU):
``pytest bench/bench_training.py -k interleaved --benchmark-only``.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

import nxops as nx
from nxops.kernels._selection import current_selection
from bench._measure import Work, assert_close, measure, nbytes
# The block, its placements and its hand-written twin: one definition, shared
# with the test that checks both compile to the same program.
from tests._training import (DP, IN_AXES, MP, PLACEMENTS, named_block, shard_map_twin,
                             training_mesh)

B, D, H, V = 128, 512, 2048, 1024    # examples per batch position, model, hidden, vocab
F32 = jnp.float32
INTERLEAVED_ROUNDS = 61   # odd: the median is one round; ~2% standard error on this noisy machine


def operands(mesh, specs):
    k = jax.random.split(jax.random.key(0), 5)
    arrays = (jax.random.normal(k[0], (MP, D, H // MP), F32) / D**0.5,
              jax.random.normal(k[1], (MP, H // MP, D), F32) / H**0.5,
              jax.random.normal(k[2], (D, V), F32) / D**0.5,
              jax.random.normal(k[3], (DP, B, D), F32),
              jax.random.randint(k[4], (DP, B), 0, V))
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]


def training_steps(placement):
    """(mesh, {impl: jitted value_and_grad step}, operands)."""
    resources = PLACEMENTS[placement]
    mesh = training_mesh()
    twin, specs = shard_map_twin(resources, mesh)
    xmapped = nx.xmap(named_block, IN_AXES, [], axis_resources=resources)
    steps = {impl: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
             for impl, f in (("baseline", twin), ("xmap", xmapped))}
    return mesh, steps, operands(mesh, specs)


def step_work(args) -> Work:
    # Forward and backward (twice the forward): the three matmuls per example.
    flops = 3 * 2 * DP * B * (2 * D * H + D * V)
    return Work(bytes_moved=nbytes(*args), flops=flops)


def info(placement, impl, **fields):
    return dict(fields, op=f"training step ({placement})", backend=impl,
                size=f"dp={DP} mp={MP}, batch {DP}x{B}, {D}-{H}-{V}",
                baseline=impl == "baseline", kernels=str(current_selection()))


def assert_same_step(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, F32)


@pytest.mark.parametrize("impl", ["baseline", "xmap"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_training_step(benchmark, peak, placement, impl):
    mesh, steps, args = training_steps(placement)
    with jax.set_mesh(mesh):
        result = measure(benchmark, steps[impl], *args, work=step_work(args), peak=peak, dtype=F32,
                         group=f"frontend-training-{placement}", info=info(placement, impl))
        assert_same_step(result, steps["baseline"](*args))


def _time_call(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_training_step_interleaved(benchmark, peak, placement):
    mesh, steps, args = training_steps(placement)
    times: dict[str, list[float]] = {"baseline": [], "xmap": []}

    def one_round():   # ABBA, A alternating between rounds
        a, b = ("xmap", "baseline") if len(times["xmap"]) % 2 else ("baseline", "xmap")
        round_times = {a: 0.0, b: 0.0}
        for impl in (a, b, b, a):
            round_times[impl] += _time_call(steps[impl], args)
        for impl, seconds in round_times.items():
            times[impl].append(seconds / 2)

    with jax.set_mesh(mesh):
        assert_same_step(steps["xmap"](*args), steps["baseline"](*args))   # also compiles both
        measure(benchmark, one_round, work=None, peak=peak, dtype=F32, rounds=INTERLEAVED_ROUNDS,
                group="frontend-training-interleaved",
                info=info(placement, "xmap and baseline, one ABBA round"))
    ratios = [x / b for x, b in zip(times["xmap"], times["baseline"])]
    benchmark.extra_info.update(
        rounds=len(ratios), ratio_median=statistics.median(ratios),
        xmap_median_s=statistics.median(times["xmap"]),
        baseline_median_s=statistics.median(times["baseline"]))
