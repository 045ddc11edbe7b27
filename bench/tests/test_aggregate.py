import csv
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from bench import aggregate
from cifar_amp import metrics
from cifar_amp.extras.diagnostics import diagnostics as D
from cifar_amp.training import train
from conftest import REPO, built_once, make_cfg, tiny_data

JOBS = [
    ["precision=32-true", "model.activation_checkpointing=0", "trainer.max_epochs=1"],
    ["precision=bf16-mixed", "model.activation_checkpointing=1", "trainer.max_epochs=1"],
]


@pytest.fixture
def sweep(make_cfg, tmp_path):
    """A finished two-job multirun (as Hydra lays it out) plus one job that never finished."""
    root = tmp_path / "multirun"
    for num, overrides in enumerate(JOBS):
        job = root / str(num)
        train(
            make_cfg(
                *overrides,
                f"run_dir={job}",
                "trainer.limit_train_batches=2",
                "module.scheduler=null",
            )
        )
        (job / ".hydra").mkdir()
        OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    (root / "2" / ".hydra").mkdir(parents=True)
    OmegaConf.save(
        OmegaConf.create(
            ["precision=16-true", "model.activation_checkpointing=0", "trainer.max_epochs=1"]
        ),
        root / "2" / ".hydra" / "overrides.yaml",
    )
    return root


def test_aggregate_tables_every_job(sweep):
    aggregate.main([str(sweep)])
    with open(sweep / "aggregate.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert [r["precision"] for r in rows] == ["32-true", "bf16-mixed", "16-true"]
    assert [r["model.activation_checkpointing"] for r in rows] == ["0", "1", "0"]
    assert "trainer.max_epochs" not in rows[0]  # the same in every job: stated once, not a column
    assert float(rows[1][metrics.TEST_ACC]) >= 0 and float(rows[0][D.IMAGES_PER_SEC]) > 0
    assert [r["status"] for r in rows] == ["ok", "ok", "no metrics.json"] and rows[2][
        metrics.TEST_ACC
    ] == ""
    md = (sweep / "aggregate.md").read_text()
    assert (
        "overrides common to all: `trainer.max_epochs=1`" in md and "| 1 | bf16-mixed | 1 |" in md
    )
    assert (sweep / "aggregate.png").read_bytes()[:4] == b"\x89PNG"


def test_aggregate_bad_input_is_one_line_exit_2(tmp_path, sweep, capsys):
    for argv in (
        [str(tmp_path / "nope")],
        [str(tmp_path / "multirun" / "2")],
        [str(sweep), "--metrics", "bogus"],
    ):
        with pytest.raises(SystemExit) as e:
            aggregate.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.slow
def test_precision_sweep_then_aggregate_cli(tmp_path, tiny_data):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "train.py",
        "experiment=precision_sweep",
        "precision=32-true,bf16-mixed",
        f"hydra.sweep.dir={sweep_dir}",
        f"data.data_dir={tiny_data}",
        "data.download=false",
        "trainer=cpu",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "logger=none",
        "model=small_cnn",
        "model.width=8",
        "data.batch_size=16",
        "module.scheduler=null",
        "trainer.enable_progress_bar=false",
    ]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
    out = subprocess.run(
        [sys.executable, "-m", "bench.aggregate", str(sweep_dir)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert "aggregate" in out.stdout
    with open(sweep_dir / "aggregate.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["precision"], r["model.activation_checkpointing"]) for r in rows} == {
        (p, k) for p in ("32-true", "bf16-mixed") for k in ("0", "1")
    }
    assert all(r["status"] == "ok" for r in rows)
