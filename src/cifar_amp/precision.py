"""Turn the `precision` config into what lightning.Trainer takes, and say what it is."""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from cifar_amp.config import PrecisionConfig, TrainerConfig


def device_type(trainer_cfg: TrainerConfig) -> str:
    """The torch device type the run will train on ("cuda" or "cpu")."""
    acc = trainer_cfg.accelerator
    if acc in ("gpu", "cuda"):
        return "cuda"
    if acc == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def trainer_kwargs(cfg: PrecisionConfig, trainer_cfg: TrainerConfig) -> dict:
    """`precision=` or `plugins=` for lightning.Trainer.

    For `16-mixed` we build the MixedPrecision plugin ourselves: on CPU, Lightning's
    string form would switch to bfloat16 and drop the scaler; we want float16 autocast
    and a GradScaler (both supported on CPU by torch) with the configured settings.
    """
    if cfg.name != "16-mixed":
        return {"precision": cfg.name}
    dev = device_type(trainer_cfg)
    s = cfg.scaler
    scaler = torch.amp.GradScaler(
        dev,
        init_scale=s.init_scale,
        growth_factor=s.growth_factor,
        backoff_factor=s.backoff_factor,
        growth_interval=s.growth_interval,
        enabled=s.enabled,
    )
    return {"plugins": [MixedPrecision("16-mixed", device=dev, scaler=scaler)]}


def describe(trainer) -> str:
    """One line: the precision plugin in use, its autocast dtype and scaler settings."""
    plugin = trainer.precision_plugin
    name = type(plugin).__name__
    if isinstance(plugin, MixedPrecision):
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
    return f"{trainer.precision}: {name}, no autocast, no GradScaler"
