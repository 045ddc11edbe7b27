import json
import os
import subprocess
import sys

import pytest

from bench import precision_modes as bench
from conftest import REPO, SHRINK, compose_cfg, tiny_data

TINY = (
    "model=small_cnn",
    "model.width=8",
    "model.hidden=32",
    "data.batch_size=16",
    "warmup_steps=2",
    "timed_steps=3",
    "module.scheduler=null",
)


def test_bench_writes_table_chart_and_overhead(tiny_data, tmp_path):
    # Composed but unresolved, as the CLI hands it over: each case's `${run_dir}` must follow it.
    bench.register()
    cfg = compose_cfg(
        bench.CONFIG_NAME,
        (
            *SHRINK,
            *TINY,
            f"data.data_dir={tiny_data}",
            f"run_dir={tmp_path}",
            "modes=[32-true-strict,32-true,bf16-mixed]",
            "checkpointing=[0,1]",
            "overhead_modes=[32-true]",
            "isolate=false",
        ),
    )
    rows = bench.run(cfg)
    assert [(r["mode"], r["checkpointing"], r["diagnostics"]) for r in rows] == [
        ("32-true-strict", 0, True),
        ("32-true-strict", 1, True),
        ("32-true", 0, True),
        ("32-true", 1, True),
        ("bf16-mixed", 0, True),
        ("bf16-mixed", 1, True),
        ("32-true", 0, False),
    ]
    for r in rows:
        assert r["step_ms"] > 0 and r["images_per_sec"] > 0 and r["peak_memory_mb"] > 0
        assert r["timed_steps"] == 3  # after the 2 warm-up steps
        assert "max_batch_size" not in r  # CPU: the finder is not run
    md = (tmp_path / "bench_precision.md").read_text()
    assert "| bf16-mixed | 1 |" in md and "PrecisionDiagnostics overhead" in md
    assert "| 32-true-strict | 0 |" in md and "Largest batch size per mode: CPU: not run" in md
    assert (tmp_path / "bench_precision.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("**/*.ckpt"))  # timing only: nothing checkpointed
    assert json.loads((tmp_path / "bench_precision.json").read_text()) == rows


@pytest.mark.slow
def test_bench_isolated_cases_via_cli(tiny_data, tmp_path):
    # The default path: each case in a fresh (spawned) process, started from the CLI.
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
    assert (tmp_path / "bench_precision.png").is_file()


def test_overhead_benchmark_times_both_sides(tiny_data):
    from bench.overhead import measure

    out = measure("precision_diagnostics", 1, [*SHRINK, f"data.data_dir={tiny_data}"])
    assert len(out["fit_seconds"]["with"]) == len(out["fit_seconds"]["without"]) == 1
    assert out["ratio_with_over_without"] == round(out["median_with"] / out["median_without"], 3)
