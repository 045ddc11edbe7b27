"""Resuming a run: the checkpoint it continues, and the settings it must keep, which `Record`
writes into every checkpoint and `Checkpoint.check_settings` compares when a run resumes."""

import re
from pathlib import Path

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback

from cifar_amp import seams
from cifar_amp.checkpoints import MODULE_CLASS, MONITOR, SETTINGS, Checkpoint, trained_by
from cifar_amp.errors import UserError


def start(cfg) -> Checkpoint | None:
    """The checkpoint this run continues (None: a new run), read once, with the optimizer kernel
    it trained with kept in `cfg` (keep_fused)."""
    path = source(cfg)
    if path is None:
        return None
    resumed = Checkpoint(path, trust=cfg.trust_checkpoint)
    keep_fused(cfg, resumed)
    return resumed


def check(cfg, resumed: Checkpoint | None, prec, module, num_classes: int, loggers: dict):
    """Refuse to continue `resumed` with other settings, classes or network (one line naming the
    first that differs); the Record callback that writes them into every checkpoint."""
    kept = settings(cfg)
    if resumed:
        resumed.check_settings(kept | {"precision": prec.name})
        resumed.check_fits(module, num_classes)
    return Record(kept, loggers, prec)


def source(cfg) -> Path | None:
    """The checkpoint to resume: `ckpt_path` (`last`/`hpc` resolved), or SLURM's requeue one."""
    ckpt, root = cfg.get("ckpt_path"), Path(cfg.run_dir)
    if ckpt == "last":
        return root / "checkpoints" / "last.ckpt"
    if ckpt == "hpc" or (ckpt is None and SLURMEnvironment.detect()):
        hpc = sorted(root.glob("hpc_ckpt_*.ckpt"), key=lambda p: int(re.sub(r"\D", "", p.stem)))
        if ckpt == "hpc" and not hpc:
            raise UserError(f"ckpt_path=hpc: no hpc_ckpt_*.ckpt in {root}")
        return hpc[-1] if hpc else None
    return Path(ckpt) if ckpt else None


def settings(cfg) -> dict:
    """What a resume must keep, by config key: the schedule and optimizer state depend on it."""
    return {
        "data.dataset": cfg.data.get("dataset", cfg.data._target_),
        "data.batch_size": cfg.data.get("batch_size"),
        # The images it trains and validates on (data/folds.py); null without folds.
        "data.folds": cfg.data.get("folds"),
        "data.fold": cfg.data.get("fold"),
        "precision": cfg.precision.name,
        "model._target_": cfg.model["_target_"],
        MODULE_CLASS: cfg.module["_target_"],
        **trained_by(cfg.module),
        # A LeanModule checkpoints each metric's running state and the monitor's best value.
        "module.metrics": sorted(cfg.module.get("metrics") or {}),
        MONITOR: cfg.monitor.metric,
    }


def keep_fused(cfg, resumed) -> None:
    """A resume keeps the optimizer kernel it was trained with (`module.optimizer.fused`): the
    state it loads sets `fused`, but not torch's flag that tells the GradScaler to hand the step
    its inf flag."""
    saved = [s["param_groups"][0] for s in resumed.data.get("optimizer_states", [])][:1]
    optimizer = cfg.module.get("optimizer")
    if saved and "fused" in saved[0] and optimizer and "fused" in optimizer:
        optimizer.fused = saved[0]["fused"]


class Record(Callback):
    """Writes the settings a resume must keep, and each tracker's run, into every checkpoint."""

    def __init__(self, settings: dict, loggers: dict, precision) -> None:  # its name, at each save
        self.settings, self.loggers, self.precision = settings, loggers, precision

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[SETTINGS] = self.settings | {"precision": self.precision.name}
        for key, logger in self.loggers.items():
            if isinstance(logger, seams.ContinuesRun):
                logger.record(checkpoint, key)
