"""Benchmark commands (`python -m cifar_amp.bench.<name>`): they measure and record, and
never assert. Measured results: docs/benchmarks-precision.md."""
