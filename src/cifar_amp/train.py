"""Train (then test the best checkpoint) from a composed config. `train.py` hands over here."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from cifar_amp import config, hydra_ddp, metrics, precision
from cifar_amp.config import TrainConfig
from cifar_amp.data import CIFARDataModule
from cifar_amp.errors import UserError, reported
from cifar_amp.module import ImageClassifier
from cifar_amp.reliability import preflight, run_dirs, run_settings, signals
from cifar_amp.reliability.atomic_io import AtomicCheckpointIO

log = logging.getLogger(__name__)


def _instantiate(node: Any, key: str, **kwargs):
    """hydra.utils.instantiate a config node, or call a class; errors name the config key."""
    try:
        return node(**kwargs) if callable(node) else instantiate(node, **kwargs)
    except Exception as e:  # a bad `_target_` or argument in YAML, reported by key
        cause = e.__cause__ or e
        raise UserError(f"cannot build {key}: {type(cause).__name__}: {cause}") from e


def build_datamodule(cfg) -> CIFARDataModule:
    d = cfg.data
    return CIFARDataModule(
        dataset=d.dataset,
        data_dir=d.data_dir,
        download=d.download,
        batch_size=d.batch_size,
        eval_batch_size=d.eval_batch_size,
        val_split=d.val_split,
        augment=d.augment,
        seed=cfg.seed,
        channels_last=getattr(getattr(cfg, "module", None), "channels_last", False),
    )


def build_module(cfg, num_classes: int) -> ImageClassifier:
    return _instantiate(
        ImageClassifier,
        "model",
        net=cfg.model,
        num_classes=num_classes,
        optimizer=_instantiate(cfg.module.optimizer, "module.optimizer"),
        scheduler=_instantiate(cfg.module.scheduler, "module.scheduler")
        if cfg.module.scheduler
        else None,
        label_smoothing=cfg.module.label_smoothing,
        channels_last=cfg.module.channels_last,
        compile=cfg.module.compile,
        tta=cfg.module.tta,
        tta_shift=cfg.module.tta_shift,
        tta_val=cfg.module.tta_val,
    )


def build_trainer(cfg, callbacks: list, loggers: list) -> L.Trainer:
    kwargs = precision.trainer_kwargs(cfg.precision, cfg.trainer)
    kwargs["plugins"] = [*kwargs.get("plugins", []), AtomicCheckpointIO()]
    trainer = L.Trainer(
        **cfg.trainer.kwargs(),
        **kwargs,
        callbacks=callbacks,
        logger=loggers or False,
        default_root_dir=cfg.run_dir,
    )
    log.info("Precision: %s", precision.describe(trainer))
    return trainer


def check_ckpt(path: str | None) -> None:
    if path and path not in preflight.CKPT_KEYWORDS:
        preflight.load_checkpoint(path)


@rank_zero_only
def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


@rank_zero_only
def save_resolved_config(cfg: DictConfig, run_dir: str) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, Path(run_dir) / "config.yaml", resolve=True)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Fit, test the best checkpoint, write `<run_dir>/metrics.json`; return those metrics."""
    L.seed_everything(cfg.seed, workers=True)
    preflight.check_hardware(cfg.trainer, cfg.precision)
    dm = build_datamodule(cfg)
    module = build_module(cfg, dm.num_classes)
    settings = run_settings.of(cfg)
    if cfg.ckpt_path and cfg.ckpt_path not in preflight.CKPT_KEYWORDS:
        run_settings.check(cfg.ckpt_path, settings)  # first: it names the setting that differs
        preflight.check_checkpoint_fits(cfg.ckpt_path, module, dm.num_classes)
    if cfg.ckpt_path:
        rank_zero_only(preflight.keep_previous_logs)(cfg.run_dir)
    loggers = [_instantiate(c, f"logger.{k}") for k, c in cfg.logger.items() if c]
    callbacks = [_instantiate(c, f"callbacks.{k}") for k, c in cfg.callbacks.items() if c]
    if not loggers:  # LearningRateMonitor refuses to run without a logger (logger=none)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    callbacks.append(run_settings.RecordRunSettings(settings))
    trainer = build_trainer(cfg, callbacks, loggers)

    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=cfg.ckpt_path)
    except SIGTERMException:  # SaveOnSignal has saved last.ckpt and said how to resume
        raise SystemExit(signals.exit_code(trainer)) from None
    fit_seconds = time.perf_counter() - start
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}

    result: dict[str, Any] = {
        metrics.PRECISION: cfg.precision.name,
        metrics.EPOCHS: trainer.current_epoch,
        metrics.FIT_SECONDS: round(fit_seconds, 3),
        metrics.VAL_ACC_BEST: fitted.get(metrics.VAL_ACC_BEST),
        **{k: fitted[k] for k in metrics.FIT_SUMMARY if k in fitted},
    }
    if cfg.test:
        ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if not ckpt:
            log.warning("No best checkpoint (no validation?): testing the final weights")
        trainer.test(module, datamodule=dm, ckpt_path=ckpt or None)
        result.update(
            {k: float(trainer.callback_metrics[k]) for k in (metrics.TEST_ACC, metrics.TEST_LOSS)}
        )
        result["tested_ckpt"] = ckpt or None
    write_json(Path(cfg.run_dir) / "metrics.json", result)
    log.info("Results: %s", json.dumps(result))
    return result


def main(cfg: DictConfig) -> float | None:
    """Hydra task function: validate, train, return `optimized_metric` for sweepers."""
    with reported(), hydra_ddp.job():
        obj: TrainConfig = config.to_object(cfg)
        with run_dirs.claim(obj.run_dir, obj.ckpt_path):
            save_resolved_config(cfg, obj.run_dir)
            result = train(obj)
        value = result.get(obj.optimized_metric)
        return None if value is None else float(value)
