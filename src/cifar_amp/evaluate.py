"""Test a checkpoint from a composed config. `eval.py` hands over here."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig

from cifar_amp import config, hydra_ddp, metrics
from cifar_amp.config import EvalConfig
from cifar_amp.errors import UserError, reported
from cifar_amp.module import ImageClassifier
from cifar_amp.reliability import preflight
from cifar_amp.train import (
    _instantiate,
    build_datamodule,
    build_trainer,
    check_ckpt,
    save_resolved_config,
    write_json,
)

log = logging.getLogger(__name__)


def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Test `cfg.ckpt_path` on the test split; write and return `<run_dir>/metrics.json`."""
    L.seed_everything(cfg.seed, workers=True)
    check_ckpt(cfg.ckpt_path)
    dm = build_datamodule(cfg)
    try:
        module = ImageClassifier.load_from_checkpoint(cfg.ckpt_path, map_location="cpu")
    except Exception as e:
        raise UserError(f"ckpt_path={cfg.ckpt_path}: cannot load ({type(e).__name__}: {e})") from e
    loggers = [_instantiate(c, f"logger.{k}") for k, c in cfg.logger.items() if c]
    preflight.check_checkpoint_fits(cfg.ckpt_path, module, dm.num_classes)
    trainer = build_trainer(cfg, callbacks=[], loggers=loggers)
    trainer.test(module, datamodule=dm)
    result = {k: float(trainer.callback_metrics[k]) for k in (metrics.TEST_ACC, metrics.TEST_LOSS)}
    result.update(
        {metrics.PRECISION: cfg.precision.name, "ckpt_path": str(Path(cfg.ckpt_path).resolve())}
    )
    write_json(Path(cfg.run_dir) / "metrics.json", result)
    log.info("Results: %s", json.dumps(result))
    return result


def main(cfg: DictConfig) -> float:
    with reported(), hydra_ddp.job():
        obj: EvalConfig = config.to_object(cfg)
        save_resolved_config(cfg, obj.run_dir)
        return evaluate(obj)[metrics.TEST_ACC]
