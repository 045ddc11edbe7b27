"""Extra (docs/fork.md): FSDP and DeepSpeed that keep the `precision` choice with its settings.

Lightning's sharding strategies take only their own precision plugins, which they make from the
Trainer's precision name: under `precision=16-mixed` they would drop `precision.scaler`, so the
core refuses them then. These subclasses take the core's 16-mixed plugin (precision.py) and make
their own from it: FSDP's with a ShardedGradScaler of the same settings, DeepSpeed's with its own
loss scaler set from them. src/cifar_amp/extras/sharding/configs/trainer/fsdp.yaml and deepspeed.yaml name them; nothing in the
core imports this module. The other modes' plugins are Lightning's, made from the name.
"""

import math

from lightning.pytorch import strategies
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, MixedPrecision
from torch.amp import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from cifar_amp.errors import UserError


def _float16_mixed(plugin) -> bool:
    return isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed"


def scaler_settings(scaler: GradScaler) -> dict:
    """A GradScaler's arguments, as `precision.scaler` set them (a disabled one keeps no others)."""
    if not scaler.is_enabled():
        return {"enabled": False}
    return {
        "init_scale": scaler.get_scale(),  # before its first step
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
    }


class FSDPStrategy(strategies.FSDPStrategy):
    """Lightning's FSDP; under `precision=16-mixed`, FSDPPrecision with a ShardedGradScaler of the
    `precision.scaler` settings (FSDP then also gathers parameters and reduces gradients in
    float16)."""

    @strategies.FSDPStrategy.precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if _float16_mixed(plugin):
            scaler = ShardedGradScaler(plugin.device, **scaler_settings(plugin.scaler))
            plugin = FSDPPrecision("16-mixed")
            # Set afterwards: Lightning 2.6.6's FSDPPrecision refuses a scaler in its constructor
            # (Lightning-AI/pytorch-lightning#19803) and makes a default one.
            plugin.scaler = scaler
        strategies.FSDPStrategy.precision_plugin.fset(self, plugin)


class DeepSpeedStrategy(strategies.DeepSpeedStrategy):
    """Lightning's DeepSpeed; under `precision=16-mixed`, DeepSpeed's own float16 engine and loss
    scaler, set from `precision.scaler` (deepspeed_loss_scaler)."""

    @strategies.DeepSpeedStrategy.precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if _float16_mixed(plugin):
            vars(self).update(deepspeed_loss_scaler(plugin.scaler))
            plugin = DeepSpeedPrecision("16-mixed")
        strategies.DeepSpeedStrategy.precision_plugin.fset(self, plugin)


def deepspeed_loss_scaler(scaler: GradScaler) -> dict:
    """DeepSpeedStrategy's fp16 loss-scaler arguments for a GradScaler's settings. DeepSpeed's
    scaler always grows by 2 and backs off by half, from a power of 2: others are refused."""
    if not scaler.is_enabled():  # a fixed scale of 1: no scaling
        return {"loss_scale": 1.0}
    s = scaler_settings(scaler)
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
