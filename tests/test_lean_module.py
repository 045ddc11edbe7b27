"""LeanModule tells instead of guessing: a step that forgets `track()`, a subclass that replaces
`configure_callbacks`, a training loader without a length, a resume with other metrics."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from omegaconf import open_dict
from torch.utils.data import DataLoader, IterableDataset

from cifar_amp import metrics
from cifar_amp.errors import UserError
from cifar_amp.module import ImageClassifier
from cifar_amp.training import build_run, train
from conftest import TOP5


class ForgetsToTrack(ImageClassifier):
    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self(x)


class OwnCallbacks(ImageClassifier):
    def configure_callbacks(self):
        return []  # no super(): the template's metrics must still be logged


def test_a_step_that_never_tracks_stops_the_run_naming_it(make_cfg, monkeypatch, tmp_path):
    cfg = make_cfg("module._target_=test_lean_module.ForgetsToTrack")
    with pytest.raises(UserError, match=r"ForgetsToTrack\.validation_step ran without calling "):
        train(cfg)
    assert not (tmp_path / "metrics.json").exists()


def test_a_subclass_that_replaces_configure_callbacks_still_logs_every_metric(make_cfg):
    result = train(make_cfg("module._target_=test_lean_module.OwnCallbacks"))
    for key in (metrics.TRAIN_ACC, metrics.VAL_ACC, metrics.VAL_ACC_BEST, metrics.TEST_ACC):
        assert 0 <= result[key] <= 1, key


class Stream(IterableDataset):
    """Images and labels with no length: Lightning cannot know an epoch's last batch ahead."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(48):
            yield torch.randn(3, 32, 32, generator=g), int(torch.randint(10, (1,), generator=g))


class StreamData(L.LightningDataModule):
    num_classes = 10

    def train_dataloader(self):
        return DataLoader(Stream(), batch_size=16)

    def val_dataloader(self):
        return DataLoader(Stream(), batch_size=16)

    test_dataloader = val_dataloader


def test_a_training_loader_without_a_length_logs_the_training_metrics(make_cfg, tmp_path):
    cfg = make_cfg("module/scheduler=none")  # a schedule needs the run's length
    with open_dict(cfg):
        cfg.data = {"_target_": "test_lean_module.StreamData"}
    result = train(cfg)
    assert 0 <= result[metrics.TRAIN_ACC] <= 1 and result[metrics.TRAIN_LOSS] > 0
    assert json.loads((tmp_path / "metrics.json").read_text())[metrics.TRAIN_ACC] is not None


def test_a_resume_with_another_metric_names_the_metrics(make_cfg, tmp_path):
    train(make_cfg())
    cfg = make_cfg(
        *TOP5,
        f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}",
        f"run_dir={tmp_path / 'more'}",
        "trainer.max_epochs=2",
    )
    with pytest.raises(UserError, match=r"module\.metrics=\['acc'\]; this run asks for "):
        build_run(cfg)


def test_a_queued_step_keeps_its_own_copy_of_the_logits():
    # Under CUDA graphs (module.compile_mode=reduce-overhead) the network's output is rewritten
    # in place by its next replay; on one H200 the queue then read another step's logits.
    from cifar_amp.lean_module import LeanModule
    from cifar_amp.module import ACCURACY

    module = LeanModule(ACCURACY, num_classes=3)
    logits, targets = torch.tensor([[0.0, 5.0, 0.0]]), torch.tensor([1])
    module.track("train", torch.tensor(0.5), logits, targets)
    logits.copy_(torch.tensor([[5.0, 0.0, 0.0]]))  # what a replay does to its output
    module.update_metrics("train")
    assert module.train_acc.compute() == 1.0
