"""Lightning's per-step host work, made cheaper (src/cifar_amp/overhead.py), and the private
Lightning behaviour each part relies on: a Lightning release that changes it fails here."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.profilers import SimpleProfiler

from cifar_amp import build, compat, metrics, overhead
from cifar_amp.training import build_run


def fit(cfg, callbacks=()):
    callbacks = [*callbacks, *build.callbacks(cfg)]
    trainer = build.trainer(cfg, callbacks=callbacks, loggers=build.loggers(cfg).values())
    dm = build.datamodule(cfg)
    module = build.module(cfg, dm.num_classes)
    trainer.fit(module, datamodule=dm)
    return trainer, module


def test_per_batch_hooks_left_as_no_ops_are_not_called(make_cfg):
    class Counting(L.Callback):
        ends = 0

        def on_train_batch_end(self, *args) -> None:
            Counting.ends += 1

    # stock: Lightning's own monitor, which defines on_train_batch_start
    counting, stock = Counting(), L.pytorch.callbacks.LearningRateMonitor()
    cfg = make_cfg("logger=csv", "callbacks=none")  # one epoch
    trainer, module = fit(cfg, [counting, stock, overhead.SkipUnusedHooks()])
    # Lightning skips a hook that is not callable (if it called it, fit would have raised);
    # each hook a class defines stays.
    assert counting.on_before_backward is None and counting.on_train_batch_start is None
    assert callable(stock.on_train_batch_start) and stock.on_before_backward is None
    assert callable(counting.setup) and callable(counting.on_train_epoch_end)
    # The module's step hooks are LightningModule's no-ops: its metrics are a callback's work.
    assert module.on_before_backward is None and module.on_train_batch_end is None
    assert callable(module.on_validation_batch_end)  # Lightning reads its signature
    assert Counting.ends == trainer.num_training_batches > 1
    assert metrics.TRAIN_ACC in trainer.callback_metrics  # logged by LeanModule's callback


class Mixin:
    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.seen.append("mixin")


class FromMixin(Mixin, L.Callback):
    pass


class SetOnTheObject(L.Callback):
    def __init__(self) -> None:
        self.on_train_batch_end = lambda trainer, *args: trainer.seen.append("attribute")


class ByGetattribute(L.Callback):
    def __getattribute__(self, name: str):
        if name == "on_before_zero_grad":
            return lambda trainer, *args: trainer.seen.append("getattribute")
        return super().__getattribute__(name)


class Static(L.Callback):
    @staticmethod
    def on_before_backward(trainer, *args) -> None:
        trainer.seen.append("static")


def test_a_callbacks_own_hook_stays_however_it_provides_it(make_cfg):
    """SkipUnusedHooks hides only a hook that is the base class's own no-op."""
    callbacks = [FromMixin(), SetOnTheObject(), ByGetattribute(), Static()]
    cfg = make_cfg("callbacks=none", "trainer.limit_train_batches=2")
    trainer = build.trainer(cfg, callbacks=[*callbacks, overhead.SkipUnusedHooks()])
    trainer.seen = []
    dm = build.datamodule(cfg)
    trainer.fit(build.module(cfg, dm.num_classes), datamodule=dm)
    per_step = ["getattribute", "static", "mixin", "attribute"]  # in Lightning's hook order
    assert trainer.seen == per_step * 2
    assert all(c.on_train_batch_start is None for c in callbacks)  # the no-ops: hidden


def test_lightning_still_names_the_running_hook_where_the_fast_path_stores_it(make_cfg):
    seen = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            seen.append(vars(pl_module).get(compat.HOOK_NAME))

    fit(make_cfg("callbacks=none", "trainer.limit_train_batches=2"), [Watch()])
    assert seen == ["on_train_batch_end"] * 2  # Lightning set it, through LeanModule's fast path


def test_the_learning_rates_in_callback_metrics_stay_on_the_host(make_cfg, monkeypatch):
    # Lightning's monitor puts each rate on the strategy's root device (a blocking copy on a
    # GPU). A meta device stands in for the GPU: Lightning's would make meta tensors there.
    cfg = make_cfg("logger=csv", "callbacks=none", "trainer.limit_train_batches=2")
    stock, ours = L.pytorch.callbacks.LearningRateMonitor(), overhead.LearningRateMonitor()
    trainer, _ = fit(cfg, [ours])
    meta = torch.device("meta")
    monkeypatch.setattr(type(trainer.strategy), "root_device", property(lambda s: meta))
    for monitor, device in ((stock, "meta"), (ours, "cpu")):
        trainer.callback_metrics.clear()
        stats = compat.learning_rate_stats(monitor, trainer, "step")
        assert list(stats) == ["lr-SGD"] and isinstance(stats["lr-SGD"], float)
        assert trainer.callback_metrics["lr-SGD"].device.type == device


def test_the_quiet_profiler_is_the_default_and_a_chosen_one_replaces_it(make_cfg):
    trainer = build.trainer(make_cfg())
    assert type(trainer.profiler) is overhead.QuietProfiler
    with trainer.profiler.profile("x") as a, trainer.profiler.profile("y") as b:
        assert a is b is None
    assert isinstance(build.trainer(make_cfg("trainer.profiler=simple")).profiler, SimpleProfiler)


def test_the_default_progress_bar_redraws_every_few_steps_and_can_be_swapped(make_cfg):
    run = build_run(make_cfg("trainer.enable_progress_bar=true"))
    bar = run.trainer.progress_bar_callback
    assert type(bar) is TQDMProgressBar and bar.refresh_rate == 10  # not Lightning's rich pick
    assert build_run(make_cfg()).trainer.progress_bar_callback is None  # enable_progress_bar=false
    rich = build_run(make_cfg("callbacks=[default,rich]", "trainer.enable_progress_bar=true"))
    assert type(rich.trainer.progress_bar_callback) is RichProgressBar


def test_the_metrics_take_the_steps_at_a_checkpoint_and_at_epoch_end(make_cfg):
    # The module keeps each step's loss, logits and targets on the device and hands them to the
    # metrics when a checkpoint is written (state_dict) or the epoch is logged.
    module = build.module(make_cfg(), num_classes=3)
    steps = [  # (loss, logits, targets): batches of 2 and 3 images, 3 of 5 right
        (0.5, [[9, 0, 0], [0, 9, 0]], [0, 0]),
        (2.0, [[0, 0, 9], [9, 0, 0], [0, 9, 0]], [[0, 0.2, 0.8], [1, 0, 0], [0.4, 0, 0.6]]),
    ]  # the second batch's targets are class weights, as mixup makes them: classes 2, 0, 2
    for loss, logits, y in steps:
        module.track("train", torch.tensor(loss), torch.tensor(logits), torch.tensor(y))
    assert module.train_acc.update_count == 0  # nothing handed over at a step
    state = module.state_dict()
    # per image: 2 x 0.5 + 3 x 2.0 over 5 images
    assert state["train_loss.mean_value"] == pytest.approx(7.0)
    assert state["train_loss.weight"] == 5
    assert module.train_acc.compute() == pytest.approx(3 / 5)
    module.state_dict()  # a second checkpoint hands over nothing twice
    assert module.train_loss.weight == 5
