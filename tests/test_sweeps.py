"""hparams_search=optuna: the searched keys exist, the objective is the best epoch's
accuracy, and a real offline search runs, stores its study and resumes it."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import optuna
import pytest
import yaml
from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution

from cifar_amp import metrics
from cifar_amp.training import train
from conftest import CONFIGS, REPO, SHRINK, compose_cfg

SEARCH = CONFIGS / "hparams_search" / "optuna.yaml"


def search_space() -> dict:
    params = OmegaConf.load(SEARCH).hydra.sweeper.params
    distributions, fixed = create_params_from_overrides([f"{k}={v}" for k, v in params.items()])
    assert not fixed
    return distributions


def test_every_searched_value_is_a_valid_config(make_cfg):
    space = search_space()
    assert set(space) >= {
        "module.optimizer.lr",
        "module.optimizer.weight_decay",
        "data.batch_size",
        "module.label_smoothing",
        "precision",
    }
    for key, dist in space.items():
        values = (
            dist.choices if isinstance(dist, CategoricalDistribution) else (dist.low, dist.high)
        )
        for value in values:
            make_cfg("hparams_search=optuna", f"{key}={value}")  # composes and validates


def test_objective_is_the_best_epoch_not_the_last(make_cfg, tmp_path):
    # On the tiny data this learning rate peaks in epoch 0 (0.5), then falls (0.0, 0.25, 0.25).
    cfg = make_cfg("trainer.max_epochs=4", "logger=csv", "module.optimizer.lr=0.1")
    result = train(cfg)
    with open(tmp_path / "metrics.csv") as f:
        per_epoch = [float(r[metrics.VAL_ACC]) for r in csv.DictReader(f) if r.get(metrics.VAL_ACC)]
    assert len(per_epoch) == 4
    assert per_epoch[-1] < max(per_epoch), "no peak before the last epoch: pick another lr"
    assert result[metrics.VAL_ACC_BEST] == pytest.approx(max(per_epoch))
    assert compose_cfg("train", ["hparams_search=optuna"]).optimized_metric == metrics.VAL_ACC_BEST


def run_search(cwd, sweep_dir, data_dir) -> None:
    # a value fixed on the command line would not be searched
    shrink = [o for o in SHRINK if not o.startswith(("data.batch_size", "module.optimizer.lr"))]
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        f"hydra.sweep.dir={sweep_dir}",
        *shrink,
        f"data.data_dir={data_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_optuna_search_runs_offline_and_resumes(tmp_path, tiny_data):
    first, second = tmp_path / "first", tmp_path / "second"
    run_search(tmp_path, first, tiny_data)
    db = tmp_path / "logs" / "train" / "optuna" / "cifar_amp.db"  # the default storage, under cwd
    assert db.is_file()
    run_search(tmp_path, second, tiny_data)  # the same command again: resumes the study

    study = optuna.load_study(study_name="cifar_amp", storage=f"sqlite:///{db}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 4
    jobs = sorted(first.glob("*/metrics.json")) + sorted(second.glob("*/metrics.json"))
    assert len(jobs) == 4
    objectives = sorted(json.loads(p.read_text())[metrics.VAL_ACC_BEST] for p in jobs)
    assert sorted(t.value for t in done) == pytest.approx(objectives)
    best = yaml.safe_load((second / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(objectives))
    assert set(best["best_params"]) == set(search_space())
