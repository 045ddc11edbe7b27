"""The speed benchmarks: the reference loop does the Lightning loop's work, and the framework
and loader commands run at a tiny size."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from hydra.utils import instantiate

from bench import framework, loader_speed, reference_loop
from cifar_amp.data.augment import Augment
from cifar_amp.data.batches import DeviceBatches
from cifar_amp.module import ImageClassifier
from conftest import built_once, compose_cfg, tiny_data


def test_reference_loop_reaches_the_same_weights_as_lightning():
    n, bs = 48, 16
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8)
    labels = torch.randint(0, 10, (n,))
    mean, std = torch.tensor([0.5] * 3), torch.tensor([0.25] * 3)
    batches = DeviceBatches(
        images,
        labels,
        bs,
        mean,
        std,
        train=True,
        augment_cfg=Augment(alternate_flip=True, translate=2),
    )
    torch.manual_seed(0)
    recipe = compose_cfg("train").module  # the default optimizer and OneCycle schedule
    module = ImageClassifier(
        {"_target_": "cifar_amp.models.speednet.SpeedNet", "widths": [8, 8, 16]},
        10,
        optimizer=recipe.optimizer,
        scheduler=recipe.scheduler,
        label_smoothing=0.2,
    )
    net = copy.deepcopy(module.net)
    try:
        L.Trainer(
            max_epochs=2,
            accelerator="cpu",
            deterministic=True,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(module, train_dataloaders=batches)
    finally:
        torch.use_deterministic_algorithms(False)  # Lightning sets it process-wide
    # As configure_optimizers builds them, for the Trainer's number of steps.
    opt = instantiate(module.hparams.optimizer, params=net.parameters())
    sched = instantiate(module.hparams.scheduler, optimizer=opt, total_steps=2 * len(batches))
    reference_loop.fit(net, batches, opt, sched, epochs=2, label_smoothing=0.2)
    for (name, a), b in zip(
        module.net.state_dict().items(), net.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow  # four Lightning/plain fits in a row
def test_framework_benchmark_runs_tiny():
    report = framework.main(
        [
            "--n-images",
            "128",
            "--batch-size",
            "16",
            "--widths",
            "8,8,8",
            "--epochs",
            "1",
            "--repeats",
            "1",
        ]
    )
    assert report["images_per_epoch"] == 128 and report["ratio_lightning_over_plain"] > 0
    # the recipe's Lightning run, every callback (experiment=speedrun_gpu)
    assert {"EMA", "PatchWhitening", "StopOnNonFiniteLoss", "PrecisionDiagnostics"} <= set(
        report["callbacks"]
    )


def test_loader_benchmark_runs_tiny(tiny_data):
    report = loader_speed.main(
        ["--data-dir", str(tiny_data), "--batch-size", "40", "--epochs", "1", "--workers", "0"]
    )
    assert report["train_images"] == 200 and report["speedup"] > 0
