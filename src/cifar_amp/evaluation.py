"""Test a checkpoint from a composed config. `eval.py` hands over here."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning as L
from omegaconf import DictConfig

from cifar_amp import build, metrics, runs
from cifar_amp.checkpoints import Checkpoint
from cifar_amp.errors import UserError

log = logging.getLogger(__name__)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test `cfg.ckpt_path` on the test split; write and return `<run_dir>/metrics.json`."""
    if not cfg.ckpt_path:
        raise UserError("ckpt_path is required, e.g. ckpt_path=<run>/checkpoints/last.ckpt")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    ckpt = Checkpoint(cfg.ckpt_path, trust=cfg.trust_checkpoint)
    prec = build.precision(cfg)
    prec.adopt(ckpt.settings.get("precision"))  # auto: the mode the checkpoint trained in
    trainer = build.trainer(cfg, prec, loggers=build.loggers(cfg).values())
    dm = build.datamodule(cfg, prec.layout)
    module = ckpt.module(channels_last=prec.layout)
    ckpt.check_fits(module, dm.num_classes)
    runs.save_config(cfg)
    trainer.test(module, datamodule=dm)
    result = {k: float(trainer.callback_metrics[k]) for k in (metrics.TEST_ACC, metrics.TEST_LOSS)}
    result |= {metrics.PRECISION: prec.name, "ckpt_path": str(Path(cfg.ckpt_path).resolve())}
    runs.write_json(Path(cfg.run_dir) / "metrics.json", result)
    log.info("Results: %s", json.dumps(result))
    return result


def main(cfg: DictConfig) -> float:
    return evaluate(cfg)[metrics.TEST_ACC]
