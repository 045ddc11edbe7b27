"""Extra (docs/fork.md): FSDP and DeepSpeed that keep the `precision` choice with its settings.

Lightning's sharding strategies take only their own precision plugins, which they make from the
Trainer's precision name: under `precision=16-mixed` they would drop `precision.scaler` (Lightning
refuses the core's plugin under its FSDP; the guards extra refuses it under its DeepSpeed). These
subclasses make their own 16-mixed plugin from `precision.scaler`, and the core builds the
Trainer with it (seams.StrategyWithFloat16Plugin): FSDP's with a ShardedGradScaler of the same
settings, DeepSpeed's with its own loss scaler set from them. Its configs/trainer/fsdp.yaml and
deepspeed.yaml name them; nothing in the core imports this module. The other modes' plugins are
Lightning's, made from the name.
"""

import inspect
import math

from lightning.pytorch import strategies
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision
from torch.amp import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from cifar_amp.errors import UserError
from cifar_amp.seams import StrategyWithFloat16Plugin, StrategyWithoutFusedOptimizers


def scaler_settings(scaler: dict) -> dict:
    """`precision.scaler` with torch.amp.GradScaler's defaults for the arguments it leaves out."""
    taken = inspect.signature(GradScaler).parameters.items()
    return {k: p.default for k, p in taken if k != "device"} | scaler


class FSDPStrategy(
    strategies.FSDPStrategy, StrategyWithFloat16Plugin, StrategyWithoutFusedOptimizers
):
    """Lightning's FSDP; under `precision=16-mixed`, FSDPPrecision with a ShardedGradScaler of the
    `precision.scaler` settings (FSDP then also gathers parameters and reduces gradients in
    float16). Torch's fused SGD fails on its flat parameters at the first step (one H200,
    torch 2.11: check_fast_path_restrictions), so trainer=fsdp asks module.optimizer.fused=false."""

    def float16_plugin(self, scaler: dict, device: str) -> FSDPPrecision:
        plugin = FSDPPrecision("16-mixed")
        # Set afterwards: Lightning 2.6.6's FSDPPrecision refuses a scaler in its constructor
        # (Lightning-AI/pytorch-lightning#19803) and makes a default one.
        plugin.scaler = ShardedGradScaler(device, **scaler)
        return plugin


class DeepSpeedStrategy(strategies.DeepSpeedStrategy, StrategyWithFloat16Plugin):
    """Lightning's DeepSpeed; under `precision=16-mixed`, DeepSpeed's own float16 engine and loss
    scaler, set from `precision.scaler` (deepspeed_loss_scaler)."""

    def float16_plugin(self, scaler: dict, device: str) -> DeepSpeedPrecision:
        vars(self).update(deepspeed_loss_scaler(scaler))
        return DeepSpeedPrecision("16-mixed")


def deepspeed_loss_scaler(scaler: dict) -> dict:
    """DeepSpeedStrategy's fp16 loss-scaler arguments for `precision.scaler`. DeepSpeed's scaler
    always grows by 2 and backs off by half, from a power of 2: others are refused."""
    s = scaler_settings(scaler)
    if not s["enabled"]:  # a fixed scale of 1: no scaling
        return {"loss_scale": 1.0}
    for key, ok, rule in (
        ("init_scale", math.log2(s["init_scale"]).is_integer(), "must be a power of 2"),
        ("growth_factor", s["growth_factor"] == 2, "must be 2"),
        ("backoff_factor", s["backoff_factor"] == 0.5, "must be 0.5"),
    ):
        if not ok:
            raise UserError(
                f"invalid config value for precision.scaler.{key}: {s[key]}; {rule} under DeepSpeed"
            )
    return {
        "loss_scale": 0.0,  # dynamic
        "initial_scale_power": int(math.log2(s["init_scale"])),
        "loss_scale_window": s["growth_interval"],
    }
