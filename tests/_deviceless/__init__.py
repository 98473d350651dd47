"""Deviceless compiles for GPUs and TPUs (no accelerator needed), shared by
the tests (tests/static/) and the benchmarks' tables (bench/static/)."""



def uncached():
    """A context whose compiles JAX's persistent compilation cache keeps no
    entry of (the tests turn the cache on: tests/conftest.py). A deviceless
    executable cannot be loaded back from it (there is no client to load it
    on: the read fails and warns), and the readers here need what a real
    compile makes: XLA's dumps, ptxas' reports. Whether the cache is used at
    all is decided once per process, so the context raises the minimum compile
    time a kept entry needs instead of turning the cache off."""
    from jax._src import config   # a config State: a context manager

    return config.persistent_cache_min_compile_time_secs(float("inf"))
