"""Two CPU processes (DDP over gloo): per-rank sharding, metric reduction across ranks, and a
Hydra multirun whose jobs each run on two ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import OmegaConf

from cifar_amp import build, metrics
from cifar_amp.module import ImageClassifier
from conftest import CPU_DDP, REPO, SHRINK

TWO_RANKS = ("trainer.accelerator=cpu", "trainer.devices=2", f"trainer.strategy={CPU_DDP}")


class RecordLabels(Callback):
    """Appends each training batch's labels to <out>/rank<r>_epoch<e>.txt."""

    def __init__(self, out):
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        path = self.out / f"rank{trainer.global_rank}_epoch{trainer.current_epoch}.txt"
        with open(path, "a") as f:
            f.write(" ".join(map(str, batch[1].tolist())) + "\n")


def plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True)


def labels_per_epoch(cfg, dm, n: int, out, epochs: int = 2) -> list[list[list[int]]]:
    """Fit on two ranks a module with one class per training sample (the label is its index);
    the labels each rank trained on, per epoch: [epoch][rank]."""
    sgd = {"_target_": "torch.optim.SGD", "lr": 0.01}
    # Plain containers: a spawned rank unpickles the module, and a schema-typed DictConfig
    # does not pickle.
    module = ImageClassifier(net=plain(cfg.model), num_classes=n, optimizer=sgd)
    build.trainer(cfg, callbacks=[RecordLabels(out)], loggers=[]).fit(module, datamodule=dm)
    return [
        [[int(v) for v in (out / f"rank{r}_epoch{e}.txt").read_text().split()] for r in (0, 1)]
        for e in range(epochs)
    ]


def test_two_ranks_see_every_training_sample_once_per_epoch(make_cfg, tmp_path):
    # 180 training images, 2 ranks x 6 batches of 15: nothing is dropped.
    cfg = make_cfg(
        *TWO_RANKS, "trainer.max_epochs=2", "data.batch_size=15", "callbacks=none", "test=false"
    )
    dm = build.datamodule(cfg)
    dm.setup()
    images, _ = dm.splits["train"]
    n = len(images)
    dm.splits["train"] = (images, torch.arange(n))  # label = sample index, one class each
    orders = []
    for ranks in labels_per_epoch(cfg, dm, n, tmp_path):
        assert len(ranks[0]) == len(ranks[1]) == n // 2
        assert sorted(ranks[0] + ranks[1]) == list(range(n))  # the union is the set, no overlap
        orders.append(ranks[0])
    assert orders[0] != orders[1]  # a fresh permutation each epoch (Lightning's set_epoch)


def test_two_rank_test_metrics_equal_one_rank(make_cfg, tmp_path):
    # 60 test images: one rank sees batches of 32 + 28, two ranks 30 each.
    one = make_cfg("trainer=cpu", "data.eval_batch_size=32")
    two = make_cfg(*TWO_RANKS, "data.eval_batch_size=32")
    module = ImageClassifier(net=plain(one.model), num_classes=10)
    ref = build.trainer(one).test(module, datamodule=build.datamodule(one), verbose=False)[0]
    got = build.trainer(two).test(module, datamodule=build.datamodule(two), verbose=False)[0]
    assert got[metrics.TEST_ACC] == pytest.approx(ref[metrics.TEST_ACC], abs=1e-6)
    assert got[metrics.TEST_LOSS] == pytest.approx(ref[metrics.TEST_LOSS], rel=1e-5)


@pytest.mark.slow
def test_multirun_of_ddp_jobs_makes_one_run_dir_per_job(tmp_path, tiny_data):
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        *SHRINK,
        "trainer=ddp_cpu",
        f"data.data_dir={tiny_data}",
        f"hydra.sweep.dir={sweep}",
        "module.label_smoothing=0.0,0.1",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job, smoothing in (("0", "0.0"), ("1", "0.1")):
        assert len(list((sweep / job).rglob("metrics.json"))) == 1
        # rank 1 ran this job (its own log, in this job's folder), not a sweep of its own
        assert (sweep / job / "train_ddp_process_1.log").is_file()
        assert f"label_smoothing: {smoothing}" in (sweep / job / "config.yaml").read_text()
    assert not (tmp_path / "logs").exists()  # no stray runs/ or multiruns/ from the children


class RecordPrecision(Callback):
    """Writes each rank's precision mode to <out>/rank<r>.txt when training starts."""

    def __init__(self, out):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        (self.out / f"rank{trainer.global_rank}.txt").write_text(trainer.precision)


@pytest.mark.skipif(CPU_DDP != "ddp_fork", reason="fakes the ranks' probes in this process")
def test_auto_on_two_ranks_trains_both_in_rank_zeros_choice(make_cfg, tmp_path, monkeypatch):
    import torch.distributed as dist

    from cifar_amp import autoprecision

    # The two ranks' probes disagree (as timings on two devices may): rank 0's choice wins.
    monkeypatch.setattr(
        autoprecision, "choose", lambda m: "bf16-mixed" if dist.get_rank() == 0 else "32-true"
    )
    cfg = make_cfg(
        *TWO_RANKS,
        "precision=auto",
        "precision.probe_seconds=1",
        "trainer.max_steps=1",
        "callbacks=none",
        "test=false",
    )
    module = ImageClassifier(net=plain(cfg.model), num_classes=10)
    trainer = build.trainer(cfg, callbacks=[RecordPrecision(tmp_path)], loggers=[])
    trainer.fit(module, datamodule=build.datamodule(cfg))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["bf16-mixed"] * 2
