"""Resumes as users run them: into a new run dir, for another length, with other settings."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from cifar_amp import metrics, schedules
from cifar_amp.checkpoints import SETTINGS, Checkpoint
from cifar_amp.errors import UserError
from cifar_amp.evaluation import evaluate
from cifar_amp.resume import source as resume_source
from cifar_amp.training import train
from test_resume import EXACT, assert_same_weights, comparable

# 180 training images in 3 steps an epoch; with so low a rate epoch 1 does not beat epoch 0.
SHORT = (*EXACT, "data.batch_size=60", "module.optimizer.lr=0.001")
CRASH = ("+callbacks.crash._target_=test_resume.CrashAt", "+callbacks.crash.step=5")


class RecordLR(L.Callback):
    """Writes (step, learning rate) of each training step of the fit to <run_dir>/lr.json."""

    def __init__(self) -> None:
        self.seen: list[list] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append([trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]])

    def on_fit_end(self, trainer, pl_module) -> None:
        (Path(trainer.default_root_dir) / "lr.json").write_text(json.dumps(self.seen))


def crashed_run(make_cfg, run_dir, *overrides):
    """A run killed after step 5; its last.ckpt is from step 4 (mid epoch 1)."""
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(*SHORT, *overrides, *CRASH, f"run_dir={run_dir}"))
    last = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4
    return last


def test_resume_into_a_new_run_dir_tests_the_same_best_checkpoint(make_cfg, tmp_path):
    common = (*SHORT, "trainer.max_epochs=2")
    train(make_cfg(*common, f"run_dir={tmp_path / 'ref'}"))
    # The case that matters: the best epoch is before the crash and the epoch after is no better.
    assert comparable(tmp_path / "ref")["tested_ckpt"] == "best-epoch000.ckpt"
    last = crashed_run(make_cfg, tmp_path / "old", "trainer.max_epochs=2")

    new = tmp_path / "new"
    train(make_cfg(*common, f"run_dir={new}", f"ckpt_path={last}"))
    assert comparable(new) == comparable(tmp_path / "ref")
    assert_same_weights(tmp_path / "ref", new)
    # Self-contained: the best checkpoint was copied in, and the old run dir left as it was.
    best = new / "checkpoints" / "best-epoch000.ckpt"
    result = json.loads((new / "metrics.json").read_text())
    assert result["tested_ckpt"] == str(best.resolve())
    assert (tmp_path / "old" / "checkpoints" / "best-epoch000.ckpt").is_file()
    evaluated = evaluate(
        make_cfg(f"ckpt_path={best}", f"run_dir={new / 'eval'}", config_name="eval")
    )
    assert evaluated[metrics.TEST_ACC] == result[metrics.TEST_ACC]


def planned_lrs(cfg, total: int) -> list[float]:
    """The learning rates of a run of `total` steps planned from the start."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.9)
    args = {k: v for k, v in cfg.module.scheduler.items() if k not in ("_target_", "max_lr")}
    sched = schedules.OneCycleLR(opt, total_steps=total, max_lr=cfg.module.optimizer.lr, **args)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_resume_for_another_length_replans_or_refuses(make_cfg, tmp_path, caplog):
    last = crashed_run(make_cfg, tmp_path / "old", "trainer.max_epochs=3")  # 9 steps planned
    record = f"+callbacks.lr._target_={__name__}.RecordLR"
    for epochs in (4, 2):  # longer; shorter, but not shorter than the 4 steps done
        run = tmp_path / f"epochs{epochs}"
        cfg = make_cfg(*SHORT, f"trainer.max_epochs={epochs}", record, f"run_dir={run}")
        train(
            make_cfg(
                *SHORT,
                f"trainer.max_epochs={epochs}",
                record,
                f"run_dir={run}",
                f"ckpt_path={last}",
            )
        )
        total = 3 * epochs
        assert f"planned for 9 steps, re-planned for {total}" in caplog.text
        seen = json.loads((run / "lr.json").read_text())
        assert [step for step, _ in seen] == list(range(4, total))
        assert [lr for _, lr in seen] == planned_lrs(cfg, total)[4:]
    with pytest.raises(
        UserError, match="this run would take 3 optimizer steps, but the checkpoint has done 4"
    ):
        train(
            make_cfg(
                *SHORT, "trainer.max_epochs=1", f"run_dir={tmp_path / 'short'}", f"ckpt_path={last}"
            )
        )


@pytest.fixture(scope="module")
def one_step_checkpoint(tmp_path_factory, tiny_data):
    from conftest import SHRINK, compose_cfg

    run = tmp_path_factory.mktemp("one_step")
    overrides = (
        *SHRINK,
        f"data.data_dir={tiny_data}",
        f"run_dir={run}",
        "trainer.max_steps=1",
        "test=false",
    )
    train(compose_cfg("train", overrides))
    return run / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize(
    "override, recorded, asked",
    [
        ("data.batch_size=32", "data.batch_size=16", "data.batch_size=32"),
        ("precision=16-mixed", "precision=32-true", "precision=16-mixed"),
        (
            "model=speednet",
            "model._target_=cifar_amp.models.small_cnn.SmallCNN",
            "model._target_=cifar_amp.models.speednet.SpeedNet",
        ),
        ("data.dataset=cifar100", "data.dataset=cifar10", "data.dataset=cifar100"),
        # The optimizer's and the schedule's state fit no other class: Lightning would load SGD's
        # momentum buffers into AdamW (a KeyError at its first step), one-cycle's into cosine.
        (
            "module/optimizer=adamw",
            "module.optimizer._target_=torch.optim.SGD",
            "module.optimizer._target_=torch.optim.AdamW",
        ),
        (
            "module/scheduler=cosine",
            "module.scheduler._target_=cifar_amp.schedules.OneCycleLR",
            "module.scheduler._target_=cifar_amp.schedules.CosineAnnealingLR",
        ),
        (
            "module/scheduler=none",
            "module.scheduler._target_=cifar_amp.schedules.OneCycleLR",
            "module.scheduler._target_=None",
        ),
    ],
)
def test_resume_with_another_setting_is_refused(
    make_cfg, one_step_checkpoint, override, recorded, asked
):
    ckpt = one_step_checkpoint
    assert torch.load(ckpt, weights_only=False)[SETTINGS]  # recorded in every checkpoint
    with pytest.raises(UserError) as e:
        train(make_cfg(override, f"ckpt_path={ckpt}"))
    assert str(e.value).startswith(
        f"ckpt_path={ckpt} was trained with {recorded}; this run asks for {asked}."
    )


def test_a_checkpoint_of_71c3482_is_refused_another_optimizer_by_its_hyperparameters(
    make_cfg, one_step_checkpoint, tmp_path
):
    old = torch.load(one_step_checkpoint, weights_only=False)
    for key in ("module.optimizer._target_", "module.scheduler._target_"):
        del old[SETTINGS][key]  # 71c3482 recorded neither; its hparams name both classes
    torch.save(old, tmp_path / "old.ckpt")
    with pytest.raises(UserError) as e:
        train(make_cfg("module/optimizer=adam", f"ckpt_path={tmp_path / 'old.ckpt'}"))
    assert "was trained with module.optimizer._target_=torch.optim.SGD; this run asks for " in (
        msg := str(e.value)
    )
    assert msg.endswith("resume with the module/optimizer it was trained with, or start a new run")


def test_checkpoint_without_the_record_is_resumed_as_before(one_step_checkpoint, tmp_path):
    old = torch.load(one_step_checkpoint, weights_only=False)
    del old[SETTINGS]
    torch.save(old, tmp_path / "old.ckpt")
    ours = {
        "data.dataset": "cifar10",
        "data.batch_size": 64,
        "precision": "bf16-mixed",
        "model._target_": "x.Y",
    }
    Checkpoint(tmp_path / "old.ckpt").check_settings(ours)  # nothing to compare with: accepted


def test_resume_source_is_the_checkpoint_lightning_will_load(make_cfg, tmp_path, monkeypatch):
    assert resume_source(make_cfg()) is None
    given = tmp_path / "x.ckpt"
    assert resume_source(make_cfg(f"ckpt_path={given}")) == given
    last = resume_source(make_cfg("ckpt_path=last"))
    assert last == tmp_path / "checkpoints" / "last.ckpt"
    for n in (2, 10):  # Lightning's SLURM requeue checkpoints: the highest number wins
        (tmp_path / f"hpc_ckpt_{n}.ckpt").touch()
    assert resume_source(make_cfg("ckpt_path=hpc")) == tmp_path / "hpc_ckpt_10.ckpt"
    assert resume_source(make_cfg()) is None  # not on SLURM: Lightning ignores them
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "job")
    assert resume_source(make_cfg()) == tmp_path / "hpc_ckpt_10.ckpt"
