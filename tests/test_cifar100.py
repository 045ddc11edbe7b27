"""CIFAR-100, the worked example of a second dataset: one config file, same loader."""

from __future__ import annotations

import torch

from cifar_amp import metrics
from cifar_amp.module import ImageClassifier
from cifar_amp.training import train
from cifar_folder import write_cifar_folder


def test_cifar100_trains_a_100_way_classifier(make_cfg, tmp_path):
    data = write_cifar_folder(tmp_path / "data", "cifar100")
    result = train(make_cfg("data=cifar100", f"data.data_dir={data}"))
    assert 0.0 <= result[metrics.TEST_ACC] <= 1.0
    module = ImageClassifier.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert module(torch.zeros(2, 3, 32, 32)).shape == (2, 100)
