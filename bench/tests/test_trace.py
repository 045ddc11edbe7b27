"""bench.trace on CPU: both loops profiled in whole-step windows, the GPU's fields n/a, host time
given to its owners (Lightning's loop only in the Lightning run), the Chrome traces written."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from bench import trace
from bench.trace import _union


@pytest.mark.slow  # two short Lightning and plain runs, profiled: about 20 s on the 2-core box
def test_a_trace_of_both_loops_on_cpu_says_where_the_host_time_goes(tmp_path):
    out = tmp_path / "out"
    data = trace.main(["--warmup", "2", "--steps", "3", "--top", "50", "--out", str(out)])
    assert json.loads((out / "trace.json").read_text()) == data
    cases = {c["loop"]: c for c in data["cases"]}
    assert list(cases) == ["lightning", "plain"] and not any("failed" in c for c in cases.values())
    for case in cases.values():
        assert case["steps"] == 3 and case["step_ms"] > 0
        assert case["host_ms_per_step"] == case["step_ms"]  # no device to wait for
        assert case["gpu_busy_fraction"] is None and case["gpu_busy_ms_per_step"] is None
        assert case["owners_ms_per_step"][trace.host_work.TORCH] > 0
        with gzip.open(out / case["trace"]) as f:
            assert json.load(f)["traceEvents"]
    lightning, plain = (
        cases["lightning"]["owners_ms_per_step"],
        cases["plain"]["owners_ms_per_step"],
    )
    assert lightning["Lightning"] > 0 and "cifar_amp.module" in lightning
    assert "Lightning" not in plain and plain["bench (the plain loop)"] > 0
    assert "TQDMProgressBar" in cases["lightning"]["callbacks"]  # the recipe as a user runs it
    assert "| gpu_busy_fraction | n/a |" in (out / "trace.md").read_text()


def test_the_gpus_busy_time_counts_overlapping_kernels_once():
    spans = [SimpleNamespace(start=s, end=e) for s, e in [(0, 10), (5, 12), (20, 25), (21, 22)]]
    assert _union(spans) == 12 + 5
