"""Timing a compiled JAX function with pytest-benchmark, and the roofline
numbers recorded beside each timing.

pytest-benchmark times with ``perf_counter`` and never synchronises with the
device; it warms up only on PyPy. So ``measure`` runs the function once first
(compilation, allocation) and times ``jax.block_until_ready(fn(*args))``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from bench import _peaks
from bench._backends import interpreted
from bench._peaks import Peak
from tests import _tolerances


@dataclasses.dataclass(frozen=True)
class Work:
    """What one call does: bytes it must move at least, and FLOPs."""

    bytes_moved: int
    flops: int = 0


def nbytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)


def assert_close(result, reference, dtype) -> None:
    """Cheap correctness check, so a ``--benchmark-disable`` run checks results too."""
    # Inputs are non-negative, so sums have no cancellation; the sizes make
    # them long sums.
    _tolerances.assert_close(result, reference, dtype, long_sum=True)


def roofline(work: Work, seconds: float, peak: Peak, dtype) -> dict[str, Any]:
    """Achieved GB/s and TFLOP/s, and the fraction of the device's peak.

    The fraction is the roofline bound ``max(bytes / bandwidth, flops /
    throughput)`` divided by the measured time: 1.0 means the call ran at the
    device's limit, whichever of memory or compute binds it.
    """
    info: dict[str, Any] = {"gbps": work.bytes_moved / seconds / 1e9}
    if work.flops:
        info["tflops"] = work.flops / seconds / 1e12
    bounds = []
    if peak.hbm_gbps:
        bounds.append(work.bytes_moved / (peak.hbm_gbps * 1e9))
    tflops = peak.tflops(dtype)
    if work.flops and tflops:
        bounds.append(work.flops / (tflops * 1e12))
    if bounds:
        info["fraction_of_peak"] = max(bounds) / seconds
    return info


def measure(benchmark, fn: Callable, *args, work: Work | None, peak: Peak, dtype,
            group: str, info: dict[str, Any], rounds: int | None = None) -> Any:
    """Benchmarks ``fn(*args)`` excluding compilation; returns its result.

    ``info`` (op, backend, size, ...) goes into ``benchmark.extra_info`` with
    the work, the device and, after a timed run, the roofline numbers from the
    fastest round (none when ``work`` is None: overheads, compile times).
    ``rounds`` fixes the number of rounds (for slow calls); otherwise
    pytest-benchmark calibrates.
    """
    result = jax.block_until_ready(fn(*args))  # compile and warm up, untimed

    def call():
        return jax.block_until_ready(fn(*args))

    benchmark.group = group
    benchmark.extra_info.update(info)
    platform = info.get("platform") or _peaks.platform()
    benchmark.extra_info.update(dtype=jnp.dtype(dtype).name, device=peak.device,
                                peak_source=peak.source, peak=dataclasses.asdict(peak),
                                platform=platform,
                                interpreted=interpreted(info.get("backend", ""), platform))
    if work is not None:
        benchmark.extra_info.update(bytes=work.bytes_moved, flops=work.flops)
    if rounds is None:
        benchmark(call)
    else:
        benchmark.pedantic(call, rounds=rounds, iterations=1)
    if work is not None and benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info.update(roofline(work, benchmark.stats.stats.min, peak, dtype))
    return result
