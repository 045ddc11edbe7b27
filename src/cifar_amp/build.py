"""Builders: turn the composed config's `_target_` nodes into objects, with `instantiate`.

Each error a constructor raises is reported by the config key it came from, on one line.
Values that one part decides for another are passed here and nowhere else: the number of
classes (data -> model), the memory layout (precision -> module, data), the run dir.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import lightning as L
import torch
from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from cifar_amp.errors import InvalidArgument, NestedBuildError, UserError
from cifar_amp.module import ImageClassifier
from cifar_amp.precision import Precision

log = logging.getLogger(__name__)


def build(node: Any, key: str, recursive: bool = True, **kwargs) -> Any:
    """`instantiate(node, **kwargs)`; any error becomes a one-line UserError naming `key`."""
    try:
        return instantiate(node, _convert_="all", _recursive_=recursive, **kwargs)
    except Exception as e:
        cause = e
        while cause.__cause__ is not None and not isinstance(cause, (InvalidArgument, UserError)):
            if isinstance(cause, NestedBuildError):
                key = cause.key
            cause = cause.__cause__
        if isinstance(cause, UserError):
            raise cause from e
        if isinstance(cause, MissingMandatoryValue):  # a required constructor argument
            raise UserError(f"{cause.full_key} is required: set {cause.full_key}=...") from e
        if isinstance(cause, InvalidArgument):
            raise UserError(f"invalid config value for {key}.{cause}") from e
        raise UserError(f"cannot build {key}: {type(cause).__name__}: {cause}") from e


def device_type(cfg: DictConfig) -> str:
    """The torch device type the run will train on ("cuda" or "cpu")."""
    acc = str(cfg.trainer.accelerator)
    if acc in ("gpu", "cuda"):
        return "cuda"
    if acc == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def precision(cfg: DictConfig) -> Precision:
    return build(cfg.precision, "precision")


def datamodule(cfg: DictConfig, channels_last: bool = False) -> L.LightningDataModule:
    # A user's DataModule need not know about memory layouts; ours lays batches out once.
    target = get_class(cfg.data._target_)
    takes_layout = "channels_last" in inspect.signature(target).parameters
    if channels_last and not takes_layout:
        log.warning(
            "Layout: the network is channels_last, but %s takes no channels_last argument: "
            "its batches keep the layout it gives them",
            target.__name__,
        )
    return build(cfg.data, "data", **({"channels_last": channels_last} if takes_layout else {}))


def module(
    cfg: DictConfig, num_classes: int, channels_last: bool = False, data_meta: dict | None = None
) -> ImageClassifier:
    # The model's config, not the model: the module builds it and saves it in checkpoints.
    # Not recursive: Hydra would build `net` without `num_classes`; the module builds it (and
    # its optimizer partials) itself.
    return build(
        cfg.module,
        "module",
        recursive=False,
        net=_plain(cfg.model),
        num_classes=num_classes,
        channels_last=channels_last,
        data_meta=data_meta,
    )


def callbacks(cfg: DictConfig) -> list[L.Callback]:
    out = [build(c, f"callbacks.{k}") for k, c in (cfg.get("callbacks") or {}).items() if c]
    if not (cfg.get("logger") or {}):  # LearningRateMonitor refuses to run without a logger
        out = [c for c in out if not isinstance(c, LearningRateMonitor)]
    return out


def loggers(cfg: DictConfig, resume: dict[str, dict] | None = None) -> list:
    """The `logger` group; `resume`: config key -> arguments that continue a tracked run
    (tracking.resume_kwargs)."""
    resume = resume or {}
    return [
        build(c, f"logger.{k}", **resume.get(k, {}))
        for k, c in (cfg.get("logger") or {}).items()
        if c
    ]


def trainer(
    cfg: DictConfig,
    prec: Precision | None = None,
    callbacks: list | None = None,
    loggers: list | None = None,
    **overrides,
) -> L.Trainer:
    """The Trainer of `cfg.trainer`, with the precision's plugins, the callbacks and loggers
    built from their groups, and the run dir as root; `overrides` win over the config."""
    t = cfg.trainer
    prec = prec or precision(cfg)
    device = device_type(cfg)
    prec.apply_tf32(device)
    kwargs = prec.trainer_kwargs(device)
    plugins = [build(p, "trainer.plugins") for p in (t.get("plugins") or [])]
    kwargs["plugins"] = [*plugins, *kwargs.get("plugins", [])]
    clip = t.get("gradient_clip_val")
    if clip is not None and clip < 0:
        raise UserError(f"invalid config value for trainer.gradient_clip_val: {clip}; must be >= 0")
    if t.get("accumulate_grad_batches", 1) < 1:
        raise UserError("invalid config value for trainer.accumulate_grad_batches: must be >= 1")
    # cudnn autotuning: on unless the run must be deterministic (null in the config)
    benchmark = t.get("benchmark")
    kwargs["benchmark"] = (not t.get("deterministic")) if benchmark is None else benchmark
    trainer = build(
        t,
        "trainer",
        **kwargs,
        callbacks=callbacks or [],
        logger=loggers or False,
        default_root_dir=cfg.run_dir,
        **overrides,
    )
    log.info("Precision: %s", prec.describe(trainer))
    return trainer


def _plain(node: Any) -> dict:
    return (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    )
