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
        assert case["ops_per_step"] > 0 and case["kernels_per_step"] == 0  # no GPU
        assert 0 < case["main_thread_ops_ms_per_step"] < case["step_ms"]
        assert case["gpu_untimed_events"] == 0
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


def test_counts_read_a_chrome_trace_per_step_and_the_main_threads_time_in_torch_ops(tmp_path):
    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        op("Optimizer.step#SGD.step", 0, 900, cat="user_annotation"),
        op("aten::conv2d", 0, 400),
        op("aten::convolution", 10, 300),  # inside conv2d: not counted twice in the time
        op("aten::add_", 1000, 200),
        op("aten::mm", 0, 5000, tid=2),  # another thread (autograd's): not the main thread's
        op("cudaLaunchKernel", 20, 5, cat="cuda_runtime"),
        op("void gemm", 0, 0, cat="kernel"),
        op("void add", 0, 0, cat="kernel"),
        op("Memcpy DtoD", 0, 0, cat="gpu_memcpy"),
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [*events, {"ph": "M", "name": "process_name"}]}, f)
    got = trace.counts(path, steps=2, top=2)
    assert got["ops_per_step"] == 2.0  # 4 ops over 2 steps
    assert (got["runtime_calls_per_step"], got["kernels_per_step"]) == (0.5, 1.0)
    assert got["copies_per_step"] == 0.5
    assert got["main_thread_ops_ms_per_step"] == 0.3  # (400 + 200) us / 2 steps
    assert got["longest_ops_ms"] == {"aten::conv2d #0": 0.4, "aten::add_ #1": 0.2}


def test_the_table_says_when_the_gpu_gave_no_times_and_when_no_python_frames_were_seen():
    case = {
        "loop": "lightning",
        "precision": "bf16-mixed",
        "steps": 20,
        "step_ms": 11.6,
        "host_ms_per_step": None,
        "host_wait_ms_per_step": None,
        "gpu_busy_ms_per_step": None,
        "gpu_busy_fraction": None,
        "gpu_untimed_events": 4080,
        "attributed_step_ms": 12.0,
        "owners_ms_per_step": {trace.NO_PYTHON: 13.7},
        "functions_ms_per_step": {},
        "ops_per_step": 824.0,
        "runtime_calls_per_step": 311.0,
        "kernels_per_step": 188.0,
        "copies_per_step": 1.1,
        "main_thread_ops_ms_per_step": 6.85,
        "longest_ops_ms": {},
    }
    text = trace.markdown({"device": "cuda", "net": "SpeedNet", "cases": [case]})
    assert "| lightning | bf16-mixed | 11.6 | 824 | 311 | 188 | 1.1 | 6.85 | 4.75 | n/a |" in text
    assert "4080 GPU events without a time" in text
    assert "recorded no Python frames" in text
