"""Published peak rates of accelerators, and the device a benchmark runs on.

Peaks are the vendors' published dense figures (no sparsity). ``f32_tflops``
is the plain FP32 rate (CUDA cores on NVIDIA); XLA may run f32 matmuls in TF32
at default precision on Ampere/Hopper, so f32 einsum fractions can exceed 1
there. TPUs publish no f32 rate (f32 matmuls run as several bf16 passes on the
MXU), so their f32 compute fraction is not reported.

On CPU there is no published number to trust: the suite measures the
machine's memory bandwidth (a jitted in-place streaming ``x * 2``) and its jnp
matmul rate once per session (see ``bench/conftest.py``) and uses those as the
peaks.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's peak memory bandwidth and matmul throughput."""

    device: str
    hbm_gbps: float | None
    bf16_tflops: float | None
    f32_tflops: float | None
    source: str = "published"

    def tflops(self, dtype) -> float | None:
        return self.bf16_tflops if jnp.dtype(dtype) == jnp.bfloat16 else self.f32_tflops


# (substrings that must all occur in the lower-cased device_kind, peak),
# most specific first. device_kind strings as JAX reports them, e.g.
# "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
# "TPU v4", "TPU v5 lite" (v5e), "TPU v5p", "TPU v6 lite" (v6e).
PUBLISHED: tuple[tuple[tuple[str, ...], Peak], ...] = (
    (("h200",), Peak("NVIDIA H200", 4800, 989, 67)),
    (("h100", "pcie"), Peak("NVIDIA H100 PCIe", 2000, 756, 51)),
    (("h100", "nvl"), Peak("NVIDIA H100 NVL", 3900, 835, 60)),
    (("h100",), Peak("NVIDIA H100 SXM", 3350, 989, 67)),
    (("a100", "40gb"), Peak("NVIDIA A100 40GB", 1555, 312, 19.5)),
    (("a100", "pcie"), Peak("NVIDIA A100 80GB PCIe", 1935, 312, 19.5)),
    (("a100",), Peak("NVIDIA A100 80GB SXM", 2039, 312, 19.5)),
    (("v4",), Peak("TPU v4", 1200, 275, None)),
    (("v5", "lite"), Peak("TPU v5e", 819, 197, None)),
    (("v5e",), Peak("TPU v5e", 819, 197, None)),
    (("v5",), Peak("TPU v5p", 2765, 459, None)),
    (("v6",), Peak("TPU v6e", 1640, 918, None)),
)


def device_kind() -> str:
    return jax.devices()[0].device_kind


def platform() -> str:
    """The lowering platform of the default device: cpu, cuda, rocm or tpu."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"


def published_peak(kind: str) -> Peak | None:
    """The published peak for a device_kind string, or None if unknown."""
    lowered = kind.lower()
    for needles, peak in PUBLISHED:
        if all(n in lowered for n in needles):
            return peak
    return None


def _best_seconds(fn, *args, repeats: int = 7) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _stream_gbps(mib: int, repeats: int = 7) -> float:
    """In-place ``x * 2`` over ``mib`` MiB of f32 (STREAM "scale"): reads and
    writes every byte. The input is donated: writing a freshly allocated output
    would time the kernel's page faults (10x slower here), not the memory."""
    scale = jax.jit(lambda v: v * 2, donate_argnums=0)
    x = scale(jnp.ones(mib * 2**18, jnp.float32))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(scale(x))
        best = min(best, time.perf_counter() - start)
    return 2 * x.nbytes / best / 1e9


def measure_cpu_peak(stream_mib: int = 128, matmul_n: int = 1024) -> Peak:
    """This machine's streaming bandwidth and jnp matmul rate, measured now.

    Bandwidth: in-place ``x * 2`` over ``stream_mib`` MiB of f32 (larger than
    the caches). Matmul: an ``n x n x n`` ``jnp.matmul`` per dtype. Small
    benchmarks that fit in the caches can exceed these "peaks".
    """
    rates = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        a = jnp.ones((matmul_n, matmul_n), dtype)
        seconds = _best_seconds(jax.jit(jnp.matmul), a, a, repeats=10)
        rates[dtype] = 2 * matmul_n**3 / seconds / 1e12
    return Peak(f"CPU ({device_kind()}, {jax.device_count()} devices)",
                round(_stream_gbps(stream_mib), 2), rates[jnp.bfloat16], rates[jnp.float32],
                source="measured")


@functools.lru_cache(maxsize=None)
def device_peak() -> Peak:
    """The peak for the default device: published, or measured (once) on CPU."""
    if platform() == "cpu":
        return measure_cpu_peak()
    peak = published_peak(device_kind())
    return peak or Peak(device_kind(), None, None, None, source="unknown device")
