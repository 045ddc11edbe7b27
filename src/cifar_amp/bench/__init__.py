"""Benchmark commands (`python -m cifar_amp.bench.<name>`): they measure and record, and
never assert. Results on the maintainers' machines are in docs/benchmarks.md."""
