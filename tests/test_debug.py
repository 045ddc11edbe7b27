"""The debug presets (configs/debug/) and the optional callbacks (early stopping, rich), each
run for real on the device-resident loader."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar

from cifar_amp import build, cli, metrics
from cifar_amp.training import train
from conftest import CONFIGS, compose_cfg, options


class RecordEpochs(L.Callback):
    """<run_dir>/epochs.json: the epoch, step and training metrics at each training epoch end."""

    rows: list

    def on_fit_start(self, trainer, pl_module) -> None:
        self.rows = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        found = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        self.rows.append({"epoch": trainer.current_epoch, "step": trainer.global_step, **found})
        (Path(trainer.default_root_dir) / "epochs.json").write_text(json.dumps(self.rows))


EPOCHS = f"+callbacks.epochs._target_={__name__}.RecordEpochs"


def results(run_dir) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def epochs(run_dir) -> list[dict]:
    return json.loads((run_dir / "epochs.json").read_text())


def test_every_preset_is_tested_here():
    # anomaly: the reliability extra's preset (tests/extras/reliability/test_reliability.py)
    assert set(options("debug")) - {"anomaly"} == {"default", "fdr", "limit", "overfit", "profiler"}
    composed = compose_cfg("train", ["debug=fdr"], return_hydra_config=True)
    assert composed.hydra.job.name == "debug"  # runs go to logs/debug/..., not logs/train/...


def test_fdr_runs_one_batch_of_each_loop_and_ends_cleanly(make_cfg, tmp_path):
    result = train(make_cfg("debug=fdr", "logger=csv", "trainer.max_epochs=5", EPOCHS))
    assert results(tmp_path) == result and metrics.TEST_ACC in result
    # No ranked checkpoint, so the test ran on the trained weights. (Lightning still writes
    # last.ckpt at train end for a `save_last` checkpointer, fast_dev_run or not.)
    assert result["tested_ckpt"] is None
    assert not any((tmp_path / "checkpoints").glob("best-*.ckpt"))
    assert [(r["epoch"], r["step"]) for r in epochs(tmp_path)] == [(0, 1)]


@pytest.mark.slow  # 120 steps
def test_overfit_drives_the_training_loss_near_zero_on_the_same_batches(make_cfg, tmp_path):
    preset = compose_cfg("train", ["debug=overfit"])
    # make_cfg shrinks to 1 epoch; lr 0.02: the tiny test net (no BatchNorm) diverges at 0.05.
    cfg = make_cfg(
        "debug=overfit",
        f"trainer.max_epochs={preset.trainer.max_epochs}",
        "module.optimizer.lr=0.02",
        EPOCHS,
    )
    assert not cfg.data.augment.flip and cfg.data.augment.translate == 0
    train(cfg)
    rows = epochs(tmp_path)
    assert len(rows) == preset.trainer.max_epochs
    assert rows[-1]["step"] == preset.trainer.max_epochs * preset.trainer.overfit_batches
    assert rows[-1][metrics.TRAIN_LOSS] < 0.05 and rows[-1][metrics.TRAIN_ACC] == 1.0


def test_overfit_batches_are_the_same_every_epoch(make_cfg):
    cfg = make_cfg("debug=overfit")
    dm = build.datamodule(cfg)
    dm.trainer = build.trainer(cfg)
    assert dm.trainer.overfit_batches == 2
    dm.setup("fit")
    loader = dm.train_dataloader()
    first = [y for _, y in loader]
    loader.set_epoch(1)
    assert all(torch.equal(a, b) for a, b in zip(first, [y for _, y in loader], strict=True))


@pytest.mark.parametrize("profiler", ["SimpleProfiler", "AdvancedProfiler"])
def test_profiler_writes_its_report_into_the_run_dir(make_cfg, tmp_path, profiler):
    target = f"lightning.pytorch.profilers.{profiler}"
    train(make_cfg("debug=profiler", f"trainer.profiler._target_={target}"))
    report = (tmp_path / "fit-profile.txt").read_text()
    assert "Profiler Report" in report
    assert ("run_training_epoch" in report) if profiler == "SimpleProfiler" else "ncalls" in report


def test_limit_runs_a_fraction_of_each_split(make_cfg, tmp_path):
    # 180 training images in 11 batches of 16: 10% is 1 batch; 20 val and 60 test images in
    # batches of 4: 25% is 1 and 3 batches.
    preset = compose_cfg("train", ["debug=limit"]).trainer
    train(
        make_cfg(
            "debug=limit",
            f"trainer.max_epochs={preset.max_epochs}",
            "data.eval_batch_size=4",
            EPOCHS,
        )
    )
    assert [r["step"] for r in epochs(tmp_path)] == [1, 2, 3]
    assert results(tmp_path)[metrics.EPOCHS] == preset.max_epochs


def test_limit_that_leaves_a_split_no_batch_is_refused_in_one_line(make_cfg):
    # 20 validation images in one batch of 32: 25% of it is no batch at all
    with pytest.raises(MisconfigurationException, match="limit_val_batches"):
        train(make_cfg("debug=limit"))


def test_early_stopping_adds_to_the_default_callbacks_and_stops(make_cfg):
    # So low a rate that validation accuracy never improves after epoch 0.
    cfg = make_cfg(
        "callbacks=[default,early_stopping]",
        "callbacks.early_stopping.patience=1",
        "trainer.max_epochs=10",
        "module.optimizer.lr=1e-7",
    )
    assert {"model_checkpoint", "early_stopping"} <= set(cfg.callbacks)
    assert train(cfg)[metrics.EPOCHS] == 2


def test_rich_progress_bar_and_model_summary_option(make_cfg):
    cfg = make_cfg(
        "callbacks=[default,rich]",
        "trainer.enable_progress_bar=true",
        "trainer.enable_model_summary=true",
    )
    trainer = build.trainer(cfg, callbacks=build.callbacks(cfg))
    assert isinstance(trainer.progress_bar_callback, RichProgressBar)
    assert sum(isinstance(c, RichModelSummary) for c in trainer.callbacks) == 1
    assert trainer.checkpoint_callback is not None  # the default callbacks are still there


def test_command_line_accepts_lists_of_callback_options_and_names_a_bad_one(capsys):
    cli.check_overrides(["callbacks=[default,early_stopping,rich]"], CONFIGS, "train")
    with pytest.raises(SystemExit) as e:
        cli.check_overrides(["callbacks=[default, richh]"], CONFIGS, "train")
    assert e.value.code == 2
    assert "callbacks=richh is not an option; valid: " in capsys.readouterr().err
