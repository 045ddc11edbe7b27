"""The `precision` choice: Lightning's precision plugin, the GradScaler, the memory layout and
TF32, decided together because each pays off only with the others."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from cifar_amp.errors import InvalidArgument

log = logging.getLogger(__name__)

NAMES = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")
SIXTEEN_BIT = ("16-mixed", "bf16-mixed", "16-true", "bf16-true")


class Precision:
    """What `precision=<name>` turns into.

    Args:
        name: Lightning's precision name. `16-mixed` is float16 autocast + GradScaler on every
            device, CPU included (Lightning alone would quietly use bfloat16 on CPU).
        scaler: torch.amp.GradScaler arguments (defaults are torch's); `16-mixed` only.
        channels_last: NHWC network and batches. null = on for 16-bit modes on CUDA, where
            tensor-core convolutions want NHWC; off elsewhere (on CPU it is slower).
        tf32: let float32 convolutions and matmuls use TF32 tensor cores on Ampere or newer
            GPUs. True is PyTorch's own default for cuDNN convolutions, so `32-true` is then
            really TF32 for a conv net; false gives strict IEEE fp32 (the slow baseline).
    """

    def __init__(
        self,
        name: str = "32-true",
        scaler: Optional[dict[str, Any]] = None,
        channels_last: Optional[bool] = None,
        tf32: bool = True,
    ) -> None:
        if name not in NAMES:
            raise InvalidArgument("name", repr(name), f"valid: {', '.join(NAMES)}")
        self.name, self.tf32, self._channels_last = name, tf32, channels_last
        self.scaler = {**scaler_defaults(), **(scaler or {})}
        s = self.scaler
        for key, ok, rule in (
            ("init_scale", s["init_scale"] > 0, "must be > 0"),
            ("growth_factor", s["growth_factor"] > 1, "must be > 1"),
            ("backoff_factor", 0 < s["backoff_factor"] < 1, "must be in (0, 1)"),
            ("growth_interval", s["growth_interval"] >= 1, "must be >= 1"),
        ):
            if not ok:
                raise InvalidArgument(f"scaler.{key}", s[key], rule)

    def channels_last(self, device: str) -> bool:
        if self._channels_last is not None:
            return self._channels_last
        return device == "cuda" and self.name in SIXTEEN_BIT

    def apply_tf32(self, device: str) -> None:
        """Process-wide switches; only CUDA reads them."""
        if device == "cuda":
            torch.backends.cudnn.allow_tf32 = self.tf32
            torch.backends.cuda.matmul.allow_tf32 = self.tf32

    def trainer_kwargs(self, device: str) -> dict:
        """`precision=` or `plugins=` for lightning.Trainer.

        For `16-mixed` we build the MixedPrecision plugin ourselves: on CPU, Lightning's
        string form would switch to bfloat16 and drop the scaler; we want float16 autocast
        and a GradScaler (both supported on CPU by torch) with the configured settings.
        """
        if self.name != "16-mixed":
            return {"precision": self.name}
        scaler = torch.amp.GradScaler(device, **self.scaler)
        return {"plugins": [MixedPrecision("16-mixed", device=device, scaler=scaler)]}

    def describe(self, trainer) -> str:
        """One line: plugin, autocast dtype, scaler settings, layout and TF32."""
        device = trainer.strategy.root_device
        cl = self.channels_last(device.type)
        layout = "channels_last (network and batches)" if cl else "contiguous (NCHW)"
        return f"{describe_plugin(trainer)}; layout {layout}{self._tf32_state(device)}"

    def _tf32_state(self, device: torch.device) -> str:
        if device.type != "cuda":
            return ""
        if torch.cuda.get_device_capability(device)[0] < 8:
            return "; TF32 n/a (needs Ampere or newer)"
        if self.tf32:
            return "; TF32 on (float32 convolutions and matmuls; precision.tf32=false: strict)"
        return "; TF32 off (strict IEEE float32)"


def describe_plugin(trainer) -> str:
    """One line: the precision plugin in use, its autocast dtype and scaler settings."""
    plugin = trainer.precision_plugin
    name = type(plugin).__name__
    if not isinstance(plugin, MixedPrecision):
        return f"{trainer.precision}: {name}, no autocast, no GradScaler"
    dtype = "bfloat16" if plugin.precision == "bf16-mixed" else "float16"
    text = f"{plugin.precision}: {dtype} autocast on {plugin.device} ({name})"
    sc = plugin.scaler
    if sc is None:
        return text + ", no GradScaler"
    if not sc.is_enabled():
        return text + ", GradScaler disabled"
    return (
        text
        + f", GradScaler(init_scale={sc.get_scale():g}, growth_factor={sc.get_growth_factor():g}, "
        f"backoff_factor={sc.get_backoff_factor():g}, growth_interval={sc.get_growth_interval()})"
    )


def scaler_defaults() -> dict[str, Any]:
    """torch.amp.GradScaler's own keyword defaults (all but `device`)."""
    params = inspect.signature(torch.amp.GradScaler).parameters
    return {k: p.default for k, p in params.items() if k != "device"}
