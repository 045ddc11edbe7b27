"""The optimizer and the schedule are config groups (module/optimizer, module/scheduler): an option
replaces the previous one's settings, holds its class's arguments, trains, and a setting that its
class does not take is refused in one line naming both."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import get_class
from torch import nn

from cifar_amp import compat, config
from cifar_amp.errors import UserError
from cifar_amp.training import build_run, train
from conftest import compose_cfg, options, spy
from test_cli import refusal


class RecordLR(L.Callback):
    """Writes the learning rate of each training step to <run_dir>/lr.json."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_fit_end(self, trainer, pl_module) -> None:
        (Path(trainer.default_root_dir) / "lr.json").write_text(json.dumps(self.seen))


@pytest.mark.parametrize("group", ["optimizer", "scheduler"])
def test_each_option_holds_its_classes_arguments_and_no_other(group):
    """Chosen after the default (SGD, one-cycle), an option keeps none of its settings."""
    for option in options(f"module/{group}"):
        node = compose_cfg("train", [f"module/{group}={option}"]).module[group]
        if option == "none":
            assert node is None
            continue
        passed = config.NOT_SETTINGS[f"module/{group}"]
        assert set(node) == {"_target_", *config.arguments(get_class(node._target_))} - {*passed}


@pytest.mark.parametrize(
    "optimizer, scheduler",
    [("sgd", "cosine"), ("adamw", "one_cycle"), ("adam", "none")],  # each option once
)
def test_each_option_trains(make_cfg, tmp_path, optimizer, scheduler):
    lr = 0.01
    cfg = make_cfg(
        f"module/optimizer={optimizer}",
        f"module/scheduler={scheduler}",
        f"module.optimizer.lr={lr}",
        "+callbacks.lr._target_=test_optimizers.RecordLR",
        "test=false",
    )
    result = train(cfg)
    assert math.isfinite(result["train/loss"])
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    group = ckpt["optimizer_states"][0]["param_groups"][0]
    assert ("betas" in group, "nesterov" in group) == (optimizer != "sgd", optimizer == "sgd")
    assert group["weight_decay"] == cfg.module.optimizer.weight_decay  # AdamW's 0.01, not 5e-4
    assert len(ckpt["lr_schedulers"]) == (scheduler != "none")
    rates = json.loads((tmp_path / "lr.json").read_text())
    total = len(rates)
    if scheduler == "none":
        assert rates == [lr] * total
    elif scheduler == "cosine":  # from lr down to eta_min (0) over the run
        assert rates == pytest.approx(
            [lr * (1 + math.cos(math.pi * t / total)) / 2 for t in range(total)]
        )
    else:  # up to lr, then down
        assert max(rates) == pytest.approx(lr) and rates[0] < lr and rates[-1] < lr


@pytest.mark.parametrize(
    "argv, key, cls",
    [
        (
            ["module/optimizer=adamw", "module.optimizer.nesterov=true"],
            "nesterov",
            "torch.optim.AdamW",
        ),
        (
            ["module/optimizer=adam", "module.optimizer.momentum=0.9"],
            "momentum",
            "torch.optim.Adam",
        ),
        (
            ["module/scheduler=cosine", "module.scheduler.pct_start=0.3"],
            "pct_start",
            "cifar_amp.schedules.CosineAnnealingLR",
        ),
    ],
)
def test_a_setting_the_chosen_class_does_not_take_is_one_line_naming_both(capsys, argv, key, cls):
    group = argv[0].split("=")[0].replace("/", ".")
    err = refusal(capsys, argv)  # before Hydra runs: nothing written
    assert err.startswith(
        f"error: {group}.{key} is not a config key; valid keys of {group} ({cls}):"
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # The command: SGD's settings kept under another class, a TypeError at fit start.
        (
            ("module.optimizer._target_=torch.optim.AdamW", "module.optimizer.lr=0.001"),
            "module.optimizer.momentum: 0.9; torch.optim.AdamW takes no momentum",
        ),
        (("module.scheduler=none",), "module.scheduler: 'none'; choose one with module/scheduler="),
        (
            ("module.optimizer=adamw",),
            "module.optimizer: 'adamw'; choose one with module/optimizer=",
        ),
    ],
)
def test_a_class_swapped_under_its_settings_is_refused_before_anything_is_written(
    make_cfg, tmp_path, overrides, expected
):
    with pytest.raises(UserError) as e:  # the command: one line, exit 2 (test_cli.py)
        build_run(make_cfg(*overrides))
    assert str(e.value).startswith(f"invalid config value for {expected}")
    assert not list(tmp_path.iterdir())


def test_a_module_built_without_an_optimizer_says_so_when_asked_to_train():
    # As rebuilt from a checkpoint older than the setting (eval needs none); Lightning would
    # fit it with no optimizer at all, leaving the weights as they were.
    from cifar_amp.module import ImageClassifier

    net = {"_target_": "cifar_amp.models.small_cnn.SmallCNN", "width": 4, "hidden": 8}
    with pytest.raises(UserError, match="module.optimizer is not set"):
        ImageClassifier(net, 10).configure_optimizers()


@pytest.mark.parametrize(
    "argv, expected",
    [
        # torch.optim's `lr: float | Tensor` is a float in the schema (it was Any: a TypeError
        # from inside torch once the module was built)
        (["module.optimizer.lr=abc"], "module.optimizer.lr=abc: Value 'abc' of type 'str'"),
        (
            ["module/scheduler=none", "module.scheduler.T_max=3"],
            "module.scheduler.T_max: module.scheduler is null, which takes no keys; choose one "
            "with module/scheduler=: cosine, none, one_cycle",
        ),
    ],
)
def test_a_wrong_type_or_a_key_of_no_schedule_is_one_line(capsys, argv, expected):
    assert refusal(capsys, argv).startswith(f"error: {expected}")


def test_fused_optimizers_handle_unscaling_and_foreach_ones_do_not(monkeypatch):
    """Lightning's test of it (compat), which the 16-mixed plugin asks before it unscales; and
    GradScaler.step then hands a fused optimizer the inf flag instead of reading it (.item())."""
    p = nn.Parameter(torch.ones(3))
    for fused in (torch.optim.SGD([p], lr=0.1, fused=True), torch.optim.Adam([p], fused=True)):
        assert compat.optimizer_handles_unscaling(fused)
    assert not compat.optimizer_handles_unscaling(torch.optim.SGD([p], lr=0.1))
    scaler, opt = torch.amp.GradScaler("cpu"), torch.optim.SGD([p], lr=0.1, fused=True)
    scaler.scale(p.sum()).backward()
    seen = spy(monkeypatch, torch.Tensor, "item")
    scaler.step(opt)
    assert not seen and p.grad is not None
