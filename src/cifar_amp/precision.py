"""The `precision` choice: Lightning's precision plugin, the GradScaler, the memory layout and
TF32, decided together because each pays off only with the others."""

from __future__ import annotations

import inspect
import logging
from typing import Annotated, Optional

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

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
            device, CPU included (Lightning alone would quietly use bfloat16 on CPU).
        scaler: torch.amp.GradScaler arguments (defaults are torch's); `16-mixed` only.
        channels_last: NHWC network and batches. null = on for 16-bit modes on CUDA, where
            tensor-core convolutions want NHWC; off elsewhere (on CPU it is slower).
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

    def channels_last(self, device: str) -> bool:
        if self._channels_last is not None:
            return self._channels_last
        return device == "cuda" and self.name in SIXTEEN_BIT

    def setup(self, trainer) -> None:
        """For the device the Trainer chose: the 16-mixed plugin with this GradScaler, TF32,
        the layout; one line in the log."""
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
            scaler = torch.amp.GradScaler(device.type, **self.scaler)
            trainer.strategy.precision_plugin = MixedPrecision("16-mixed", device.type, scaler)
        if device.type == "cuda":  # process-wide switches that only CUDA reads
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = self.tf32
        self.layout = self.channels_last(device.type)
        log.info("Precision: %s", self.describe(trainer))
        if device.type == "cpu" and self.name in FLOAT16:
            log.warning(
                "Precision: %s on CPU: float16 has no fast CPU kernels for most of the network, so "
                "expect each step to take many times as long as under 32-true; for speed on CPU "
                "use precision=bf16-mixed (or 32-true). float16 on CPU is for checking fp16 "
                "numerics",
                self.name,
            )

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
    if not isinstance(plugin, MixedPrecision):
        return f"{trainer.precision}: {type(plugin).__name__}, no autocast, no GradScaler"
    dtype = "bfloat16" if plugin.precision == "bf16-mixed" else "float16"
    text, sc = (
        f"{plugin.precision}: {dtype} autocast on {plugin.device} ({type(plugin).__name__})",
        plugin.scaler,
    )
    if sc is None or not sc.is_enabled():
        return text + (", no GradScaler" if sc is None else ", GradScaler disabled")
    return (
        f"{text}, GradScaler(init_scale={sc.get_scale():g}, growth_factor={sc.get_growth_factor():g}, "
        f"backoff_factor={sc.get_backoff_factor():g}, growth_interval={sc.get_growth_interval()})"
    )
