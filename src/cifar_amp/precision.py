"""The `precision` choice: Lightning's precision plugin, the GradScaler, the memory layout and
TF32, decided together because each pays off only with the others."""

from __future__ import annotations

import inspect
import logging
import math
from typing import Annotated, Optional

import torch
from lightning.pytorch.plugins.precision import (
    DeepSpeedPrecision,
    FSDPPrecision,
    MixedPrecision,
)
from lightning.pytorch.plugins.precision import Precision as Plugin
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, Strategy

from cifar_amp import metrics
from cifar_amp.config import Nested
from cifar_amp.errors import InvalidArgument, UserError

log = logging.getLogger(__name__)
NAMES = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")
SIXTEEN_BIT = ("16-mixed", "bf16-mixed", "16-true", "bf16-true")
FLOAT16 = ("16-mixed", "16-true")


class Precision:
    """What `precision=<name>` turns into; `setup(trainer)` applies it once the device is known.

    Args:
        name: Lightning's precision name. `16-mixed` is float16 autocast + GradScaler on every
            device, CPU included (Lightning alone would quietly use bfloat16 on CPU), and under
            every strategy (FSDP: its sharded GradScaler; DeepSpeed: its own loss scaler).
            (`precision=auto`, an extra, chooses one of these at fit start: autoprecision.py.)
        scaler: torch.amp.GradScaler arguments (defaults are torch's); `16-mixed` only.
        channels_last: NHWC network and batches. null = on for 16-bit modes on CUDA, where
            tensor-core convolutions want NHWC, and on CPU for the 32-bit and bfloat16 modes,
            whose oneDNN convolutions run NHWC (a SpeedNet step 1.3-1.5x faster, ResNet-18
            1.1x on the dev box: docs/benchmarks.md); off for 32-true on CUDA and for float16
            on CPU (slower there), and on other devices.
        tf32: let float32 convolutions and matmuls use TF32 tensor cores (Ampere or newer).
            True is PyTorch's own default for cuDNN convolutions, so `32-true` is then really
            TF32 for a conv net; false gives strict IEEE fp32 (the slow baseline).
    """

    def __init__(
        self,
        name: str = "32-true",
        scaler: Annotated[Optional[dict], Nested(torch.amp.GradScaler, ("device",))] = None,
        channels_last: Optional[bool] = None,
        tf32: bool = True,
    ) -> None:
        if name not in NAMES:
            raise InvalidArgument("name", repr(name), f"valid: {', '.join(NAMES)}")
        self.name, self.tf32, self._channels_last = name, tf32, channels_last
        self.layout: bool | None = None  # channels_last or not: decided by setup()
        params = inspect.signature(torch.amp.GradScaler).parameters
        s = self.scaler = {k: p.default for k, p in params.items() if k != "device"} | (
            scaler or {}
        )
        for key, ok, rule in (
            ("init_scale", s["init_scale"] > 0, "must be > 0"),
            ("growth_factor", s["growth_factor"] > 1, "must be > 1"),
            ("backoff_factor", 0 < s["backoff_factor"] < 1, "must be in (0, 1)"),
            ("growth_interval", s["growth_interval"] >= 1, "must be >= 1"),
        ):
            if not ok:
                raise InvalidArgument(f"scaler.{key}", s[key], rule)

    @property
    def trainer_precision(self) -> str:
        """The Trainer's `precision=`. The 16-mixed plugin is made for the device the Trainer
        picks (setup), so such a Trainer starts in 32-true."""
        return "32-true" if self.name == "16-mixed" else self.name

    @property
    def autocasts(self) -> bool:
        """Whether steps may run under autocast (the fused optimizer then cannot clip)."""
        return self.name in ("16-mixed", "bf16-mixed")

    def channels_last(self, device: str) -> bool:
        if self._channels_last is not None:
            return self._channels_last
        if device == "cpu":
            return self.name not in FLOAT16
        return device == "cuda" and self.name in SIXTEEN_BIT

    def adopt(self, recorded: str | None) -> None:
        """Told the mode a checkpoint was trained in (resume, eval, predict): a fixed mode keeps
        its own (the resume's settings check compares them); a mode chosen at run time takes it
        (autoprecision.AutoPrecision)."""

    def record(self) -> dict:
        """What metrics.json says of the precision: the mode trained in."""
        return {metrics.PRECISION: self.name}

    def setup(self, trainer) -> None:
        """For the device the Trainer chose: the 16-mixed plugin with this GradScaler, TF32,
        the layout; one line in the log."""
        strategy = type(trainer.strategy)
        device = trainer.strategy.root_device
        if (
            device.type == "cuda"
            and self.name.startswith("bf16")
            and not torch.cuda.is_bf16_supported()
        ):
            raise UserError(
                f"precision={self.name}: {torch.cuda.get_device_name(device)} has no bfloat16 "
                "support; valid here: 16-mixed, 32-true, 16-true"
            )
        if self.name == "16-mixed":
            plugin = trainer.strategy.precision_plugin = self.plugin(strategy, device.type)
            if isinstance(plugin, DeepSpeedPrecision):
                vars(trainer.strategy).update(self.deepspeed_loss_scaler())
        if device.type == "cuda":  # process-wide switches that only CUDA reads
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = self.tf32
        self.layout = self.channels_last(device.type)
        self.announce(trainer)

    def announce(self, trainer) -> None:
        """The fit-start log line; a warning for float16 on CPU."""
        log.info("Precision: %s", self.describe(trainer))
        if trainer.strategy.root_device.type == "cpu" and self.name in FLOAT16:
            log.warning(
                "Precision: %s on CPU: float16 has no fast CPU kernels for most of the network, "
                "so expect each step to take many times as long as under 32-true; for speed on "
                "CPU use precision=bf16-mixed (or 32-true). float16 on CPU is for checking fp16 "
                "numerics",
                self.name,
            )

    def plugin(self, strategy: type[Strategy], device: str, name: str | None = None) -> Plugin:
        """The precision plugin of mode `name` (default: this choice) for a Trainer with this
        strategy on this device type, with this GradScaler for 16-mixed. Made here only where
        Lightning's own, made from the Trainer's precision name, would not do: 16-mixed (whose
        Trainer starts in 32-true, see trainer_precision) and modes chosen at fit start."""
        name = name or self.name
        if issubclass(strategy, FSDPStrategy):  # Lightning's FSDP takes only FSDPPrecision
            plugin = FSDPPrecision(name)
            if name == "16-mixed":
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                # Set afterwards: Lightning 2.6.6's FSDPPrecision refuses a scaler in its
                # constructor (Lightning-AI/pytorch-lightning#19803) and makes a default one.
                plugin.scaler = ShardedGradScaler(device, **self.scaler)
            return plugin
        if issubclass(strategy, DeepSpeedStrategy):  # scales the loss itself: setup()
            return DeepSpeedPrecision(name)
        if name == "16-mixed":
            return MixedPrecision(name, device, torch.amp.GradScaler(device, **self.scaler))
        if name == "bf16-mixed":
            return MixedPrecision(name, device)
        if name == "32-true":
            return Plugin()
        raise ValueError(f"precision {name!r}: Lightning makes its plugin from the name")

    def deepspeed_loss_scaler(self) -> dict:
        """DeepSpeedStrategy's fp16 loss-scaler arguments for these GradScaler settings.
        DeepSpeed's scaler always grows by 2 and backs off by half, from a power of 2."""
        s = self.scaler
        power = math.log2(s["init_scale"])
        for key, ok, rule in (
            ("init_scale", power.is_integer(), "must be a power of 2 under DeepSpeed"),
            ("growth_factor", s["growth_factor"] == 2, "must be 2 under DeepSpeed"),
            ("backoff_factor", s["backoff_factor"] == 0.5, "must be 0.5 under DeepSpeed"),
        ):
            if not ok:
                raise UserError(
                    f"invalid config value for precision.scaler.{key}: {s[key]}; {rule}"
                )
        if not s["enabled"]:  # a fixed scale of 1: no scaling
            return {"loss_scale": 1.0}
        return {
            "loss_scale": 0.0,  # dynamic
            "initial_scale_power": int(power),
            "loss_scale_window": s["growth_interval"],
        }

    def describe(self, trainer) -> str:
        """One line: plugin, autocast dtype, scaler settings, layout and TF32."""
        layout = "channels_last (network and batches)" if self.layout else "contiguous (NCHW)"
        text, device = f"{describe_plugin(trainer)}; layout {layout}", trainer.strategy.root_device
        if device.type != "cuda":
            return text
        if torch.cuda.get_device_capability(device)[0] < 8:
            return text + "; TF32 n/a (needs Ampere or newer)"
        if self.tf32:
            return (
                text + "; TF32 on (float32 convolutions and matmuls; precision.tf32=false: strict)"
            )
        return text + "; TF32 off (strict IEEE float32)"


def describe_plugin(trainer) -> str:
    """One line: the precision plugin in use, its autocast dtype and scaler settings."""
    plugin = trainer.precision_plugin
    mixed = getattr(plugin, "precision", None) in ("16-mixed", "bf16-mixed")
    if not (mixed and isinstance(plugin, (MixedPrecision, FSDPPrecision, DeepSpeedPrecision))):
        return f"{trainer.precision}: {type(plugin).__name__}, no autocast, no GradScaler"
    dtype = "bfloat16" if plugin.precision == "bf16-mixed" else "float16"
    if isinstance(plugin, DeepSpeedPrecision):
        return (
            f"{plugin.precision}: DeepSpeed's {dtype} engine and loss scaler (DeepSpeedPrecision)"
        )
    # FSDP autocasts on CUDA only (and gathers its sharded parameters in `dtype`)
    device = getattr(plugin, "device", "cuda")
    text, sc = (
        f"{plugin.precision}: {dtype} autocast on {device} ({type(plugin).__name__})",
        plugin.scaler,
    )
    if sc is None or not sc.is_enabled():
        return text + (", no GradScaler" if sc is None else ", GradScaler disabled")
    return (
        f"{text}, {type(sc).__name__}(init_scale={sc.get_scale():g}, "
        f"growth_factor={sc.get_growth_factor():g}, backoff_factor={sc.get_backoff_factor():g}, "
        f"growth_interval={sc.get_growth_interval()})"
    )
