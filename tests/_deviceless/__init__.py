"""Deviceless compiles for GPUs and TPUs (no accelerator needed), shared by
the tests (tests/static/) and the benchmarks' tables (bench/static/)."""
