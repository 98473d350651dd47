"""nxops benchmarks: ``pytest bench --benchmark-only`` (see bench/README.md)."""
