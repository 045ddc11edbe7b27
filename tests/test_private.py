"""Every private Lightning/torch name the package relies on still exists and still means what
reliability/private.py says, on the installed versions."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from cifar_amp.reliability import private


def test_local_path_rule():
    assert private.is_local_path("/runs/a/last.ckpt") and private.is_local_path("file:///a.ckpt")
    assert not private.is_local_path("s3://bucket/last.ckpt")


def test_sigterm_flag_is_the_one_the_trainer_reads():
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    private.set_received_sigterm(trainer, True)
    assert trainer.received_sigterm
    private.set_received_sigterm(trainer, False)
    assert not trainer.received_sigterm


def test_scale_tensor_is_the_scale_without_a_sync():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert private.scale_tensor(scaler) is None  # created lazily, on first use
    scaler.scale(torch.ones(()))
    scale = private.scale_tensor(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == scaler.get_scale() == 1024.0


def test_batchnorm_base_covers_every_batchnorm_and_nothing_else():
    for bn in (nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm2d()):
        assert isinstance(bn, private.BatchNorm) and hasattr(bn, "running_mean")
    for other in (nn.LayerNorm(2), nn.GroupNorm(1, 2), nn.InstanceNorm2d(2)):
        assert not isinstance(other, private.BatchNorm)


def test_flat_params_are_the_keys_mlflow_logger_logs(monkeypatch):
    """Checked against MLFlowLogger.log_hyperparams itself, with its MLflow client replaced."""
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    from lightning.pytorch.loggers import MLFlowLogger

    logged = {}

    class Client:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def log_batch(self, run_id, params=(), **kwargs) -> None:
            logged.update({p.key: p.value for p in params})

    monkeypatch.setattr(mlflow_tracking, "MlflowClient", Client)
    monkeypatch.setattr(MLFlowLogger, "experiment", property(lambda self: Client()))
    monkeypatch.setattr(MLFlowLogger, "run_id", property(lambda self: "r"))
    params = {"a": {"b": 1, "c": [{"d": 2}], "e": {}}, "f": None, "g": [1, 2]}
    MLFlowLogger(tracking_uri="sqlite:///unused.db").log_hyperparams(params)
    flat = private.flat_params(params)
    assert {k: str(v) for k, v in flat.items()} == logged
    assert set(flat) == {"a/b", "a/c/0/d", "f", "g"}


def test_fused_optimizers_say_they_unscale_and_the_scaler_then_reads_nothing():
    p = nn.Parameter(torch.ones(3))
    assert private.optimizer_unscales(torch.optim.SGD([p], lr=0.1, fused=True))
    assert not private.optimizer_unscales(torch.optim.SGD([p], lr=0.1))
    # GradScaler.step hands a fused optimizer the inf flag instead of reading it (.item()).
    scaler, opt = torch.amp.GradScaler("cpu"), torch.optim.SGD([p], lr=0.1, fused=True)
    scaler.scale(p.sum()).backward()
    seen = []
    original = torch.Tensor.item
    torch.Tensor.item = lambda t: seen.append(t) or original(t)
    try:
        scaler.step(opt)
    finally:
        torch.Tensor.item = original
    assert not seen and p.grad is not None
