"""Opt-in autotuning on the GPU at hand (``NXOPS_AUTOTUNE=on``; off by default,
bench/README.md says why).

The first time a case (op, operand shapes and dtypes, parameters) is lowered
for a real local GPU, `auto` times every backend that can take it on random
data of that shape and keeps the winner (a kernel only at <= 0.95x XLA's time,
as with the measured tables) in an on-disk cache per GPU kind and nxops
version, as jax-triton's autotuner and XLA's GEMM autotuner do. Later
lowerings read the cache.

Never in a deviceless lowering (no GPU: nothing to time, the tables decide),
in ``nx.export`` (an artifact must not depend on this machine's timings) or
in ``nx.kernels.explain`` (which executes nothing: it shows the tables' choice).

``NXOPS_AUTOTUNE_CACHE`` names the cache directory (default
``~/.cache/nxops/autotune``).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import pathlib
import time
from typing import Any, Callable, Iterator, Sequence

from nxops import _config
from nxops.kernels import _measured

_CALLS_PER_SAMPLE, _SAMPLES = 20, 3

# The devices the op being lowered targets (set by nxops.ops around `choose`).
_DEVICES: contextvars.ContextVar[tuple] = contextvars.ContextVar("nxops_autotune_devices",
                                                                 default=())
# Set inside nx.export, nx.kernels.explain and the timing runs themselves.
_SUPPRESSED: contextvars.ContextVar[bool] = contextvars.ContextVar("nxops_autotune_off",
                                                                   default=False)

Timer = Callable[[str, str, Sequence[Any], dict], float]


@contextlib.contextmanager
def lowering_for(devices: Sequence) -> Iterator[None]:
    """Ops lowered in this block target ``devices``."""
    token = _DEVICES.set(tuple(devices))
    try:
        yield
    finally:
        _DEVICES.reset(token)


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """No autotuning within this block (export, explain, the timing runs)."""
    token = _SUPPRESSED.set(True)
    try:
        yield
    finally:
        _SUPPRESSED.reset(token)


def _is_local_gpu(device) -> bool:
    import jax
    try:
        return device in jax.local_devices(backend="gpu")
    except RuntimeError:   # no GPU backend: a deviceless (topology) device
        return False


def active(platform: str) -> bool:
    """Whether the op being lowered for ``platform`` is to be autotuned."""
    devices = _DEVICES.get()
    return (_config.autotune() and platform == "cuda" and not _SUPPRESSED.get()
            and bool(devices) and _is_local_gpu(devices[0]))


def gpu_kind() -> str:
    devices = _DEVICES.get()
    return str(getattr(devices[0], "device_kind", "unknown GPU")) if devices else "unknown GPU"


def cache_path(kind: str) -> pathlib.Path:
    """The cache file of one GPU kind and this nxops version."""
    import nxops
    directory = _config.autotune_cache()
    name = "".join(c if c.isalnum() else "_" for c in kind)
    return directory / f"{name}-nxops-{nxops.__version__}.json"


def case_key(op: str, avals: Sequence[Any], params: dict) -> str:
    operands = ",".join(f"{a.dtype}{list(a.shape)}" for a in avals)
    return f"{op}({operands}) {sorted((k, repr(v)) for k, v in params.items())}"


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: pathlib.Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(cache, indent=1, sort_keys=True))
    partial.replace(path)   # atomic: concurrent processes never read half a file


def decide(times: dict[str, float]) -> str:
    """The backend to keep: the fastest kernel if at most THRESHOLD of XLA's
    time (timing noise must not swap XLA for a custom call), else xla."""
    kernels = {b: t for b, t in times.items() if b != "xla"}
    if "xla" not in times or not kernels:
        return min(times, key=times.get)
    best = min(kernels, key=kernels.get)
    return best if kernels[best] <= _measured.THRESHOLD * times["xla"] else "xla"


def winner(op: str, avals: Sequence[Any], params: dict, backends: Sequence[str],
           timer: Timer | None = None, kind: str | None = None) -> tuple[str, str]:
    """(backend, why) for this case among ``backends``: from the cache, else
    timed with ``timer(op, backend, avals, params)`` (seconds) and cached."""
    kind = kind or gpu_kind()
    path, key = cache_path(kind), case_key(op, avals, params)
    cache = _read(path)
    entry = cache.get(key)
    if entry is None or entry["backend"] not in backends:
        times = {b: (timer or time_on_device)(op, b, avals, params) for b in backends}
        entry = {"backend": decide(times), "us": {b: t * 1e6 for b, t in times.items()}}
        cache[key] = entry
        _write(path, cache)
    timed = ", ".join(f"{b} {us:.1f} us" for b, us in sorted(entry["us"].items()))
    return entry["backend"], f"autotuned on {kind} ({timed}; cache {path})"


def time_on_device(op: str, backend: str, avals: Sequence[Any], params: dict) -> float:
    """Seconds per call of ``backend``'s kernel on random operands of ``avals``
    on the default GPU: the best of a few samples, each of queued calls (a
    single call's wall clock would measure dispatch)."""
    import functools
    import jax
    import numpy as np
    from nxops.kernels import _registry

    rng = np.random.default_rng(0)
    args = [jax.device_put(rng.standard_normal(a.shape).astype(a.dtype)
                           if np.issubdtype(a.dtype, np.inexact) else np.zeros(a.shape, a.dtype))
            for a in avals]
    kernel = _registry.lookup(op, backend)
    with suppressed():
        fn = jax.jit(functools.partial(kernel.fn, platform="cuda", **params))
        jax.block_until_ready(fn(*args))   # compile and warm up
        samples = []
        for _ in range(_SAMPLES):
            start = time.perf_counter()
            for _ in range(_CALLS_PER_SAMPLE):
                out = fn(*args)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - start) / _CALLS_PER_SAMPLE)
    return min(samples)
