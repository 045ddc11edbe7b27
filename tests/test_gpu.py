"""On CUDA: every precision mode trains with the dtypes it promises, the GradScaler backs off
on overflow, each mode runs its faster layout, TF32 follows its setting (activation checkpointing's
peak memory: tests/extras/resnet18/test_resnet.py;
FSDP: tests/extras/sharding/test_sharding.py). `pytest -m gpu`; skipped
without CUDA."""

from __future__ import annotations

import logging
import math

import lightning as L
import pytest
import torch
from lightning import Callback

from cifar_amp import build
from conftest import deterministic_grads_twice, requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

ON_CUDA = ("trainer.accelerator=gpu", "trainer.devices=1", "callbacks=none", "test=false")
# (parameter dtype, dtype of the network's output) per mode
DTYPES = {
    "32-true": (torch.float32, torch.float32),
    "16-mixed": (torch.float32, torch.float16),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
}


class Record(Callback):
    """Losses, parameter dtypes and devices, output dtypes, and the layout of batches and
    activations, as training runs (Lightning's teardown moves the module to the CPU after fit)."""

    def __init__(self) -> None:
        self.losses, self.batches_nhwc, self.conv_out_nhwc = [], [], []
        self.params, self.devices, self.outputs = set(), set(), set()

    def on_fit_start(self, trainer, pl_module) -> None:
        conv = next(m for m in pl_module.net.modules() if isinstance(m, torch.nn.Conv2d))
        conv.register_forward_hook(
            lambda m, i, o: self.conv_out_nhwc.append(
                o.is_contiguous(memory_format=torch.channels_last)
            )
        )
        pl_module.net.register_forward_hook(lambda m, i, o: self.outputs.add(o.dtype))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x = batch[0]
        assert x.is_cuda
        self.batches_nhwc.append(x.is_contiguous(memory_format=torch.channels_last))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.params |= {p.dtype for p in pl_module.net.parameters()}
        self.devices |= {p.device.type for p in pl_module.net.parameters()}


def fit(cfg, *callbacks):
    """Built as cifar_amp.training.train builds a run (the layout from the precision)."""
    L.seed_everything(cfg.seed)
    prec = build.precision(cfg)
    trainer = build.trainer(cfg, prec, callbacks, enable_checkpointing=False)
    dm = build.datamodule(cfg, channels_last=prec.channels_last)
    module = build.module(cfg, dm.num_classes, channels_last=prec.channels_last)
    trainer.fit(module, datamodule=dm)
    return trainer, module, prec


def needs(mode: str) -> None:
    if mode.startswith("bf16") and not torch.cuda.is_bf16_supported():
        pytest.skip(f"{torch.cuda.get_device_name()} has no bfloat16")


@pytest.mark.parametrize("mode", DTYPES)
def test_every_mode_trains_with_finite_loss_and_its_dtypes(make_cfg, mode):
    needs(mode)
    rec = Record()
    cfg = make_cfg(*ON_CUDA, f"precision={mode}", "trainer.max_steps=4", "module.scheduler=null")
    trainer, module, _ = fit(cfg, rec)
    assert trainer.global_step == 4 and len(rec.losses) == 4
    assert all(math.isfinite(v) for v in rec.losses), rec.losses
    params, outputs = DTYPES[mode]
    assert rec.params == {params} and rec.outputs == {outputs}
    assert rec.devices == {"cuda"}  # while training: fit's teardown moves the module to the CPU


def test_fp16_overflow_backs_off_the_scale_on_cuda(make_cfg):
    cfg = make_cfg(
        *ON_CUDA,
        "precision=16-mixed",
        "precision.scaler.init_scale=1e30",  # overflows float16 gradients at once
        "trainer.max_steps=1",
        "module.scheduler=null",
    )
    before, after = {}, {}

    class Keep(Callback):  # both on the GPU: fit's teardown moves the module to the CPU
        def on_train_start(self, trainer, pl_module):
            before.update({k: v.clone() for k, v in pl_module.net.state_dict().items()})

        def on_train_end(self, trainer, pl_module):
            after.update({k: v.clone() for k, v in pl_module.net.state_dict().items()})

    trainer, _, _ = fit(cfg, Keep())
    scaler = trainer.precision_plugin.scaler
    assert scaler.get_scale() == pytest.approx(0.5e30)
    weights = [k for k in after if "weight" in k]
    assert weights and all(torch.equal(before[k], after[k]) for k in weights)  # step skipped


@pytest.mark.parametrize(
    "mode, settings, nhwc",
    [  # each mode's default: its faster layout (H100, ResNet-18 b512, at 25a5182)
        ("16-mixed", (), True),
        ("bf16-mixed", (), True),
        ("16-true", (), True),
        ("bf16-true", (), True),
        ("32-true", (), True),  # TF32 on
        ("32-true", ("precision.tf32=false",), False),
        ("16-mixed", ("precision.channels_last=false",), False),
        ("32-true", ("precision.tf32=false", "precision.channels_last=true"), True),
    ],
)
def test_each_mode_runs_its_layout_on_cuda(make_cfg, mode, settings, nhwc, caplog):
    needs(mode)
    cfg = make_cfg(*ON_CUDA, f"precision={mode}", *settings, "trainer.max_steps=2")
    rec = Record()
    with caplog.at_level(logging.INFO, logger="cifar_amp.precision"):
        _, module, _ = fit(cfg, rec)
    conv = next(m for m in module.net.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) is nhwc
    assert rec.batches_nhwc == [nhwc] * 2  # every batch, laid out by the data
    assert all(v is nhwc for v in rec.conv_out_nhwc) and rec.conv_out_nhwc
    assert f"Precision: {mode}, layout {'channels_last' if nhwc else 'NCHW'}, TF32" in caplog.text


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_follows_its_setting_and_is_stated(make_cfg, tf32, caplog):
    # Whether the GPU has TF32 cores at all (Ampere or newer): the diagnostics extra's line.
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        cfg = make_cfg(*ON_CUDA, "precision=32-true", f"precision.tf32={str(tf32).lower()}")
        with caplog.at_level(logging.INFO, logger="cifar_amp.precision"):
            build.trainer(cfg, build.precision(cfg), [], [])
        assert torch.backends.cudnn.allow_tf32 is tf32
        assert torch.backends.cuda.matmul.allow_tf32 is tf32
        # (and its layout: channels_last with TF32, NCHW in strict fp32)
        layout = "channels_last" if tf32 else "NCHW"
        assert f"Precision: 32-true, layout {layout}, TF32 {'on' if tf32 else 'off'}" in caplog.text
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_speednet_trains_deterministically_on_cuda():
    # nn.AdaptiveMaxPool2d's CUDA backward has no deterministic kernel: trainer.deterministic=true
    # stopped SpeedNet's first step on one H200 (torch 2.11). Its pool shares a tie's gradient.
    from cifar_amp.models.speednet import SpeedNet

    first, second = deterministic_grads_twice(SpeedNet(widths=(8, 16, 16)))
    assert torch.equal(first, second)
