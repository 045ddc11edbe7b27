"""The metric that ranks a run's checkpoints is a setting (`monitor.metric`, `monitor.mode`):
a forker judged by F1, or by a loss, says so, and everything that ranks follows."""

from __future__ import annotations

import csv
import json

import pytest

from cifar_amp import metrics
from cifar_amp.errors import UserError
from cifar_amp.evaluation import main as eval_main
from cifar_amp.training import build_run, train
from conftest import compose_cfg

F1 = (
    "~module.metrics.acc",
    "+module.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
)


def per_epoch(run_dir, key: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def test_f1_instead_of_accuracy_trains_to_the_end_and_keeps_the_best_f1_checkpoint(
    make_cfg, tmp_path
):
    cfg = make_cfg(*F1, "monitor.metric=f1", "trainer.max_epochs=3", "logger=csv")
    assert cfg.callbacks.model_checkpoint.monitor == "val/f1"
    assert cfg.optimized_metric == "val/f1_best"
    result = train(cfg)
    f1 = per_epoch(tmp_path, "val/f1")
    assert len(f1) == 3 and result[metrics.EPOCHS] == 3
    assert result["val/f1_best"] == pytest.approx(max(f1))
    assert metrics.VAL_ACC_BEST not in result and metrics.TEST_ACC not in result
    assert result[metrics.TESTED_CKPT].endswith(f"best-epoch{f1.index(max(f1)):03d}.ckpt")
    # eval.py returns the test value of the metric that ranked the run, and says which
    eval_cfg = make_cfg(
        f"ckpt_path={result[metrics.TESTED_CKPT]}",
        f"run_dir={tmp_path / 'eval'}",
        config_name="eval",
    )
    assert eval_main(eval_cfg) == pytest.approx(result["test/f1"])
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())[metrics.MONITOR] == "f1"
    # a resume that ranks by another metric is refused, naming the setting
    resumed = make_cfg(
        *F1,
        "+module.metrics.acc._target_=torchmetrics.classification.MulticlassAccuracy",
        f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}",
        f"run_dir={tmp_path / 'resumed'}",
        "trainer.max_epochs=4",
    )
    with pytest.raises(UserError, match=r"module\.metrics=\['f1'\]; this run asks for "):
        build_run(resumed)


def test_the_loss_as_monitor_keeps_the_lowest(make_cfg, tmp_path):
    cfg = make_cfg("monitor.metric=loss", "monitor.mode=min", "trainer.max_epochs=2", "logger=csv")
    result = train(cfg)
    losses = per_epoch(tmp_path, metrics.VAL_LOSS)
    assert len(losses) == 2 and result["val/loss_best"] == pytest.approx(min(losses))
    assert result[metrics.TESTED_CKPT].endswith(f"best-epoch{losses.index(min(losses)):03d}.ckpt")


@pytest.mark.parametrize(
    "overrides, said",
    [
        (F1, "monitor.metric=acc names no metric of this run; its metrics: loss, f1"),
        (("monitor.metric=f2",), "monitor.metric=f2 names no metric of this run"),
        (("monitor.metric=loss",), "monitor.mode=max for loss, where lower is better"),
        (("monitor.mode=min",), "monitor.mode=min for acc, where higher is better"),
        # Lightning's checkpoint callback is built first, and says it in one line
        (("monitor.mode=up",), "model_checkpoint: .*`mode` can be min, max but got up"),
        (("monitor.mode=up", "callbacks=none"), "monitor.mode=up: valid: max, min"),
    ],
)
def test_a_monitor_the_run_cannot_rank_by_is_one_line_before_anything_runs(
    make_cfg, tmp_path, overrides, said
):
    with pytest.raises(UserError, match=said):
        build_run(make_cfg(*overrides))
    assert not (tmp_path / "checkpoints").exists()


def test_early_stopping_and_the_search_follow_the_monitor():
    cfg = compose_cfg(
        "train",
        ("callbacks=[default,early_stopping]", "monitor.metric=loss", "monitor.mode=min"),
    )
    assert cfg.callbacks.early_stopping.monitor == metrics.VAL_LOSS
    assert cfg.callbacks.early_stopping.mode == "min"
    assert cfg.callbacks.model_checkpoint.mode == "min"
    assert compose_cfg("train").optimized_metric == metrics.VAL_ACC_BEST  # the default


def test_the_search_minimises_a_loss_it_monitors():
    pytest.importorskip("cifar_amp.extras.sweeps")
    pytest.importorskip("optuna")
    cfg = compose_cfg(
        "train",
        ("hparams_search=optuna", "monitor.metric=loss", "monitor.mode=min"),
        return_hydra_config=True,
    )
    assert cfg.hydra.sweeper.direction == "minimize"
    assert cfg.callbacks.optuna_pruning.monitor == metrics.VAL_LOSS
    assert cfg.optimized_metric == "val/loss_best"
    default = compose_cfg("train", ("hparams_search=optuna",), return_hydra_config=True)
    assert default.hydra.sweeper.direction == "maximize"
