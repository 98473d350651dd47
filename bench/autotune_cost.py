"""What the first lowering of a case costs with ``NXOPS_AUTOTUNE`` on, on CPU.

    python -m bench.autotune_cost [--repeat 3]

No GPU here, so two figures stand in for one:

- *machinery*: a program lowered for cuda with autotuning on, the lowering's
  devices taken for a local GPU and a fake timer (no time of its own): what
  autotuning adds around the timing (the candidates' checks, the on-disk
  cache), against the same lowering with autotuning off;
- *per candidate*: ``_autotune.time_on_device`` for the ``xla`` backend run
  on this CPU (a compile and 3 x 20 calls on random operands): what each
  candidate costs at the first lowering. On a GPU the calls are faster and
  each kernel's compile (Triton, Mosaic) is added: not measured here.

A case is timed once per GPU kind and nxops version (the cache), then read.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp

import nxops as nx
from nxops import _config
from nxops.kernels import _autotune

CASES = {
    "rows logsumexp 4096x4096 f32": (lambda x: nx.logsumexp(x, 1), ((4096, 4096), jnp.float32),
                                     "reduce", dict(axes=(1,), op="logsumexp")),
    "column sum 4096x4096 bf16": (lambda x: nx.sum(x, 0), ((4096, 4096), jnp.bfloat16),
                                  "reduce", dict(axes=(0,), op="sum")),
    "rows logsumexp 16384x8192 f32": (lambda x: nx.logsumexp(x, 1),
                                      ((16384, 8192), jnp.float32), "reduce",
                                      dict(axes=(1,), op="logsumexp")),
}


def _lower_seconds(fn, aval) -> float:
    fresh = lambda x: fn(x)
    start = time.perf_counter()
    jax.jit(fresh).trace(aval).lower(lowering_platforms=("cuda",))
    return time.perf_counter() - start


def machinery(fn, aval, cache_dir: str) -> tuple[float, float]:
    """(seconds to lower for cuda with autotuning off, on with the fake timer)."""
    off = _lower_seconds(fn, aval)
    real_is_gpu, real_timer = _autotune._is_local_gpu, _autotune.time_on_device
    _autotune._is_local_gpu = lambda device: True
    _autotune.time_on_device = lambda op, backend, avals, params: {"xla": 2e-5}.get(backend, 1e-5)
    try:
        with _config.AUTOTUNE("on"), _config.AUTOTUNE_CACHE(cache_dir):
            on = _lower_seconds(fn, aval)
    finally:
        _autotune._is_local_gpu, _autotune.time_on_device = real_is_gpu, real_timer
    return off, on


def per_candidate(op: str, aval, params: dict) -> float:
    start = time.perf_counter()
    _autotune.time_on_device(op, "xla", [aval], params)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="best of this many")
    args = parser.parse_args(argv)
    print("| case | lower for cuda, autotune off (s) | on, fake timer (s) | xla candidate "
          "timed on CPU (s) |\n|---|---|---|---|")
    for name, (fn, (shape, dtype), op, params) in CASES.items():
        aval = jax.ShapeDtypeStruct(shape, dtype)
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as cache:   # a first lowering each time
                runs.append(machinery(fn, aval, cache))
        off, on = min(r[0] for r in runs), min(r[1] for r in runs)
        candidate = min(per_candidate(op, aval, params) for _ in range(args.repeat))
        print(f"| {name} | {off:.3f} | {on:.3f} | {candidate:.2f} |", flush=True)


if __name__ == "__main__":
    main()
