"""Benchmark commands (`python -m bench.<name>`, from the repo root): they measure and
record, and never assert. Clients of the package's public names only: delete bench/ and
nothing else breaks. Measured results: docs/benchmarks*.md."""

# The one extra outside src/<pkg>/extras/: its commands are `python -m bench.<name>` from the
# repository root. The extras its benchmarks use (.ci/extras.py reads this):
NEEDS = ("diagnostics", "speedrun", "auto_precision", "resnet18", "reliability", "multirun")
