"""Benchmark commands (`python -m bench.<name>`, from the repo root): they measure and
record, and never assert. Clients of the package's public names only: delete bench/ and
nothing else breaks. Measured results: docs/benchmarks*.md."""
