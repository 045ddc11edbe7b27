import json
import os
import subprocess
import sys

import pytest

from bench import memory
from bench import precision_modes as bench
from cifar_amp.errors import UserError
from conftest import REPO, SHRINK, built_once, compose_cfg, requires_cuda, tiny_data

TINY = (
    "model=small_cnn",
    "model.width=8",
    "model.hidden=32",
    "data.batch_size=16",
    "warmup_steps=2",
    "timed_steps=3",
    "module.scheduler=null",
)


def bench_cfg(tiny_data, tmp_path, *overrides):
    # Composed but unresolved, as the CLI hands it over: each case's `${run_dir}` must follow it.
    bench.register()
    return compose_cfg(
        bench.CONFIG_NAME,
        (*SHRINK, *TINY, f"data.data_dir={tiny_data}", f"run_dir={tmp_path}", *overrides),
    )


@pytest.mark.slow  # every mode trained, a table, a chart: a benchmark end to end
def test_bench_writes_table_chart_and_overhead(tiny_data, tmp_path):
    cfg = bench_cfg(
        tiny_data,
        tmp_path,
        "modes=[32-true-strict,bf16-mixed]",  # on CPU, 32-true is 32-true-strict
        "checkpointing=[0,1,[0]]",
        "overhead_modes=[32-true]",
        "isolate=false",  # one process: also the path that reuses the loaded data
    )
    rows = bench.run(cfg)
    assert [(r["mode"], r["checkpointing"], r["diagnostics"]) for r in rows] == [
        (mode, ck, True) for mode in ("32-true-strict", "bf16-mixed") for ck in (0, 1, [0])
    ] + [("32-true", 0, False)]
    for r in rows:
        assert r["step_ms"] > 0 and r["images_per_sec"] > 0 and r["peak_memory_mb"] > 0
        assert r["timed_steps"] == 3  # after the 2 warm-up steps
        assert "max_batch_size" not in r  # CPU: the search is not run
    traced = {(r["mode"], str(r["checkpointing"])): r for r in rows if r["diagnostics"]}
    for mode in ("32-true-strict", "bf16-mixed"):
        off = traced[(mode, "0")]
        # Checkpointing frees activations, never model state.
        for ck in ("1", "[0]"):
            assert traced[(mode, ck)]["activations_mb"] < off["activations_mb"]
            assert traced[(mode, ck)]["state_mb"] == off["state_mb"]
    # bf16 autocast halves what the convolutions keep; the fp32 weights stay.
    assert (
        traced[("bf16-mixed", "0")]["activations_mb"]
        < traced[("32-true-strict", "0")]["activations_mb"]
    )
    assert traced[("bf16-mixed", "0")]["state_mb"] == traced[("32-true-strict", "0")]["state_mb"]
    md = (tmp_path / "bench_precision.md").read_text()
    assert "| bf16-mixed | stages 0 |" in md and "| 32-true-strict | every 1 |" in md
    assert "speed vs 32-true-strict" in md and "activations (MB)" in md
    assert "| 32-true-strict | off |" in md and "Largest batch size per mode: not run" in md
    assert "PrecisionDiagnostics overhead" in md
    assert (tmp_path / "bench_precision.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("**/*.ckpt"))  # timing only: nothing checkpointed
    assert json.loads((tmp_path / "bench_precision.json").read_text()) == rows


def test_memory_breakdown_alone_needs_no_training(tiny_data, tmp_path):
    cfg = bench_cfg(
        tiny_data, tmp_path, "modes=[32-true,16-true]", "checkpointing=[0]", "timing=false"
    )
    a, b = bench.run(cfg)
    assert "step_ms" not in a and not (tmp_path / "32-true_off").exists()
    assert b["state_mb"] == pytest.approx(a["state_mb"] / 2, rel=0.01)  # 16-bit weights
    md = (tmp_path / "bench_precision.md").read_text()
    assert "| 16-true | off | - |" in md and "Timing not run" in md


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["checkpointing=[-1]"], "checkpointing: \\[-1\\]; each entry"),
        (["checkpointing=[[7]]"], "model.checkpoint_stages: \\[7\\]; stages are 0..1"),
        (["modes=[fp8]"], "modes: \\['fp8'\\]; valid"),
        (["timing=false", "memory_breakdown=false"], "nothing to measure"),
    ],
)
def test_bad_bench_settings_are_refused(tiny_data, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        bench.run(bench_cfg(tiny_data, tmp_path, *overrides))


@pytest.mark.parametrize("largest, guess", [(1000, 400), (1000, 5000), (1000, 1000), (7, 3)])
def test_batch_search_brackets_the_largest_fitting_batch(largest, guess):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= largest

    lo, hi = memory.largest_fitting(fits, guess, limit=10**6, trials=12, tol=0.05)
    assert lo <= largest < hi and hi - lo <= max(1, 0.05 * lo)
    assert len(tried) <= 12


def test_batch_search_stops_at_the_limit_and_within_its_trials():
    assert memory.largest_fitting(lambda b: True, 100, limit=120, trials=5) == (120, None)
    lo, hi = memory.largest_fitting(lambda b: b <= 900, 100, limit=10**6, trials=3)
    assert (lo, hi) == (158, None)  # 100 -> 126 -> 158 fit; no failure within 3 runs
    assert memory.largest_fitting(lambda b: False, 4, limit=100, trials=2) == (None, 3)


@pytest.mark.slow
def test_bench_isolated_cases_via_cli(tiny_data, tmp_path):
    # The default path on CPU: each case in a fresh (spawned) process, started from the CLI.
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [
        sys.executable,
        "-m",
        "bench.precision_modes",
        *SHRINK,
        *TINY,
        f"data.data_dir={tiny_data}",
        f"hydra.run.dir={tmp_path}",
        "modes=[32-true]",
        "checkpointing=[0]",
        "overhead_modes=[]",
    ]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    (row,) = json.loads((tmp_path / "bench_precision.json").read_text())
    assert row["mode"] == "32-true" and row["step_ms"] > 0 and row["peak_memory_mb"] > 0
    assert row["activations_mb"] > 0
    assert (tmp_path / "bench_precision.png").is_file()


def test_overhead_benchmark_times_both_sides(tiny_data):
    from bench.overhead import measure

    out = measure("precision_diagnostics", 1, [*SHRINK, f"data.data_dir={tiny_data}"])
    assert len(out["fit_seconds"]["with"]) == len(out["fit_seconds"]["without"]) == 1
    assert out["ratio_with_over_without"] == round(out["median_with"] / out["median_without"], 3)


@pytest.mark.gpu
@requires_cuda
def test_bench_on_cuda_shares_one_process_and_finds_the_largest_batch(tiny_data, tmp_path):
    cfg = bench_cfg(
        tiny_data,
        tmp_path,
        "trainer.accelerator=gpu",
        "modes=[32-true-strict,32-true,16-mixed]",
        "checkpointing=[0,[0]]",
        "overhead_modes=[]",
        "batch_size_trials=3",
    )
    rows = bench.run(cfg)  # isolate=null: one process on CUDA
    for r in rows:
        assert r["peak_memory_mb"] > r["base_memory_mb"] > 0 and r["peak_warmup_mb"] > 0
        assert 0 < r["step_peak_mb"] < r["peak_memory_mb"]
        assert r["activations_mb"] > 0
    found = [r for r in rows if r["checkpointing"] == 0]
    # 180 tiny training images: the small net fits them all in one batch.
    assert [r["max_batch_size"] for r in found] == [r["batch_limit"] for r in found] == [180] * 3
    md = (tmp_path / "bench_precision.md").read_text()
    assert "max batch >= 180 (all training images)" in md and "over the timed steps" in md
