"""Test a checkpoint from a composed config. `eval.py` hands over here."""

from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from cifar_amp import build, metrics, runs
from cifar_amp.checkpoints import Checkpoint
from cifar_amp.errors import UserError


def evaluate(cfg: DictConfig) -> dict:
    """Test `cfg.ckpt_path` on the test split; write and return `<run_dir>/metrics.json`."""
    if not cfg.ckpt_path:
        raise UserError("ckpt_path is required, e.g. ckpt_path=<run>/checkpoints/last.ckpt")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    ckpt = Checkpoint(cfg.ckpt_path, trust=cfg.trust_checkpoint)
    prec = build.precision(cfg, ckpt)  # a precision that follows a checkpoint takes its mode
    trainer = build.trainer(cfg, prec, loggers=build.loggers(cfg).values())
    dm = build.datamodule(cfg, prec.channels_last)
    module = build.module_from_checkpoint(ckpt, channels_last=prec.channels_last)
    ckpt.check_fits(module, dm.num_classes)
    runs.save_config(cfg)
    trainer.test(module, datamodule=dm)
    path = str(Path(cfg.ckpt_path).resolve())
    return runs.write_metrics(
        cfg, metrics.tested(trainer) | {metrics.PRECISION: prec.name, "ckpt_path": path}
    )


def main(cfg: DictConfig) -> float:
    return evaluate(cfg)[metrics.TEST_ACC]
