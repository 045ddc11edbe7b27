"""Test a checkpoint from a composed config. `eval.py` hands over here."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig

from cifar_amp import build, hydra_ddp, metrics
from cifar_amp.errors import UserError
from cifar_amp.module import ImageClassifier
from cifar_amp.reliability import preflight
from cifar_amp.training import save_resolved_config, write_json

log = logging.getLogger(__name__)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test `cfg.ckpt_path` on the test split; write and return `<run_dir>/metrics.json`."""
    if not cfg.ckpt_path:
        raise UserError("ckpt_path is required, e.g. ckpt_path=<run>/checkpoints/last.ckpt")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    prec = build.precision(cfg)
    preflight.load_checkpoint(cfg.ckpt_path)
    dm = build.datamodule(cfg, channels_last=prec.channels_last(build.device_type(cfg)))
    try:
        module = ImageClassifier.load_from_checkpoint(cfg.ckpt_path, map_location="cpu")
    except Exception as e:
        raise UserError(f"ckpt_path={cfg.ckpt_path}: cannot load ({type(e).__name__}: {e})") from e
    preflight.check_checkpoint_fits(cfg.ckpt_path, module, dm.num_classes)
    save_resolved_config(cfg, cfg.run_dir)
    trainer = build.trainer(cfg, prec, callbacks=[], loggers=build.loggers(cfg))
    trainer.test(module, datamodule=dm)
    result = {k: float(trainer.callback_metrics[k]) for k in (metrics.TEST_ACC, metrics.TEST_LOSS)}
    result.update({metrics.PRECISION: prec.name, "ckpt_path": str(Path(cfg.ckpt_path).resolve())})
    write_json(Path(cfg.run_dir) / "metrics.json", result)
    log.info("Results: %s", json.dumps(result))
    return result


def main(cfg: DictConfig) -> float:
    with hydra_ddp.job():
        return evaluate(cfg)[metrics.TEST_ACC]
