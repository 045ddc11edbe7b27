"""Test a checkpoint from a composed config (`eval.py` hands over here), and what a test reports,
here and at the end of `train.py`."""

from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from cifar_amp import build, metrics, runs, seams
from cifar_amp.checkpoints import Checkpoint
from cifar_amp.errors import UserError
from cifar_amp.lean_module import LeanModule


def evaluate(cfg: DictConfig) -> dict:
    """Test `cfg.ckpt_path` on the test split; write and return `<run_dir>/metrics.json`."""
    if not cfg.ckpt_path:
        raise UserError("ckpt_path is required, e.g. ckpt_path=<run>/checkpoints/last.ckpt")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    ckpt = Checkpoint(cfg.ckpt_path, trust=cfg.trust_checkpoint)
    prec = build.precision(cfg, ckpt)  # a precision that follows a checkpoint takes its mode
    callbacks, loggers = build.callbacks(cfg), build.loggers(cfg).values()
    trainer = build.trainer(cfg, prec, callbacks, loggers)
    dm = build.datamodule(cfg, prec.channels_last)
    module = build.module_from_checkpoint(ckpt, channels_last=prec.channels_last)
    ckpt.check_fits(module, dm.num_classes)
    runs.save_config(cfg)
    trainer.test(module, datamodule=dm)
    path = str(Path(cfg.ckpt_path).resolve())
    return runs.write_metrics(
        cfg, tested(trainer) | {metrics.PRECISION: prec.name, "ckpt_path": path}
    )


def tested(trainer: L.Trainer) -> dict:
    """What `trainer.test` logged (every `test/` metric), as metrics.json holds it, and each
    class's accuracy where the module counted them (a LeanModule's confusion matrix)."""
    out = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
    module = trainer.lightning_module
    if isinstance(module, LeanModule) and module.confusion is not None:
        names = seams.class_names(trainer.datamodule, len(module.confusion))
        right, seen = module.confusion.diagonal(), module.confusion.sum(1)
        accuracy = (right / seen.clamp_min(1)).tolist()
        # A class with no test images has no accuracy.
        per_class = [a if n else None for a, n in zip(accuracy, seen.tolist(), strict=True)]
        out[metrics.TEST_ACC_PER_CLASS] = dict(zip(names, per_class, strict=True))
    return out


def main(cfg: DictConfig) -> float | None:  # a module of your own may log no test/acc
    return evaluate(cfg).get(metrics.TEST_ACC)
