"""Train (then test the best checkpoint) from a composed config. `train.py` hands over here."""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from cifar_amp import build, checkpoints, metrics, runs
from cifar_amp.checkpoints import Checkpoint
from cifar_amp.errors import UserError
from cifar_amp.precision import Precision

log = logging.getLogger(__name__)


@dataclass
class Run:
    cfg: DictConfig
    precision: Precision
    trainer: L.Trainer
    datamodule: L.LightningDataModule
    module: L.LightningModule
    loggers: dict[str, Any]
    resumed: Checkpoint | None  # the checkpoint this run continues, read once
    fit_seconds: float | None = None
    fitted: dict[str, Any] = field(default_factory=dict)  # what fit logged (last values)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit, test the best checkpoint, write `<run_dir>/metrics.json`; return those metrics."""
    run = build_run(cfg)
    with guard(run):
        fit(run)
        tested = test(run)
        return report(run, tested)


def build_run(cfg: DictConfig) -> Run:
    """Everything the run needs, range-checked, and the resume checked; nothing is written yet."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    start = build.per_stage_ranks(cfg.trainer.strategy)
    if start and not HydraConfig.initialized():  # a command starts such ranks once (build)
        raise UserError(
            f"trainer.strategy={cfg.trainer.strategy}: ranks started by {start} are new "
            "processes for each of fit and test, so the run's CSV log and epoch count would be "
            "lost; run train.py (which starts them once) or use trainer.strategy=ddp from a script"
        )
    prec = build.precision(cfg)
    callbacks = build.callbacks(cfg)
    source = checkpoints.resume_source(cfg)
    resumed = Checkpoint(source, trust=cfg.trust_checkpoint) if source else None
    settings = checkpoints.run_settings(cfg)
    if resumed:  # first: it names the setting that differs
        prec.adopt(resumed.settings.get("precision"))  # auto: the choice of the run resumed
        resumed.check_settings(settings | {"precision": prec.name})
    loggers = build.loggers(cfg, resumed.tracker_versions(cfg.logger) if resumed else None)
    callbacks.append(checkpoints.Record(settings, loggers, prec))
    trainer = build.trainer(cfg, prec, callbacks, loggers.values())
    dm = build.datamodule(cfg, prec.layout)
    # A DataModule of yours need not have `meta`; predict then refuses its checkpoints.
    module = build.module(cfg, dm.num_classes, prec.layout, getattr(dm, "meta", None))
    if resumed:
        resumed.check_fits(module, dm.num_classes)
    # A callback that starts the run from other weights (the fine-tuning extra) gets the built
    # module now, so that weights that do not fit stop the run before anything is written.
    for cb in callbacks:
        if hasattr(cb, "before_run"):
            cb.before_run(module)
    return Run(cfg, prec, trainer, dm, module, loggers, resumed)


@contextlib.contextmanager
def guard(run: Run):
    """Hold the run dir (refused if another run holds or used it), record the resolved config
    there and give it to every logger."""
    with runs.claim(run.cfg.run_dir, resuming=run.resumed is not None):
        runs.save_config(run.cfg)
        config = OmegaConf.to_container(run.cfg, resolve=True)
        for lg in run.loggers.values():
            lg.log_hyperparams(config)
        yield


def fit(run: Run) -> None:
    start = time.perf_counter()
    trust = run.cfg.trust_checkpoint
    try:
        with torch.serialization.safe_globals(checkpoints.SAFE_TYPES):
            run.trainer.fit(
                run.module,
                datamodule=run.datamodule,
                ckpt_path=run.resumed and run.resumed.path,
                weights_only=not trust,
            )
    except SIGTERMException as e:  # the shell's code for a run a signal stopped: 128 + it
        # (the reliability extra has saved last.ckpt and said how to resume; it sets `signum`)
        raise SystemExit(128 + getattr(e, "signum", signal.SIGTERM)) from None
    run.fit_seconds = round(time.perf_counter() - start, 3)
    run.fitted = {k: float(v) for k, v in run.trainer.callback_metrics.items()}


def test(run: Run) -> dict[str, Any]:
    """Test the best checkpoint (the final weights where there is none)."""
    if not run.cfg.test:
        return {}
    cb = run.trainer.checkpoint_callback
    ckpt = cb.best_model_path if cb else ""
    if not ckpt:
        log.warning("No best checkpoint (no validation?): testing the final weights")
    with torch.serialization.safe_globals(checkpoints.SAFE_TYPES):
        run.trainer.test(
            run.module, datamodule=run.datamodule, ckpt_path=ckpt or None, weights_only=True
        )
    found = run.trainer.callback_metrics
    tested = {k: float(found[k]) for k in (metrics.TEST_ACC, metrics.TEST_LOSS)}
    return tested | {metrics.TESTED_CKPT: ckpt or None}


def report(run: Run, tested: dict[str, Any]) -> dict[str, Any]:
    """`<run_dir>/metrics.json`, and its numbers to every logger, whose run then ends."""
    result = {
        **run.precision.record(),
        metrics.EPOCHS: run.trainer.current_epoch,
        metrics.FIT_SECONDS: run.fit_seconds,
        metrics.VAL_ACC_BEST: run.fitted.get(metrics.VAL_ACC_BEST),
        **run.fitted,
        **tested,
    }
    runs.write_json(Path(run.cfg.run_dir) / "metrics.json", result)
    numbers = {
        k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    # The loggers have the rest; the best validation accuracy (the sweeps' objective) goes with
    # the outcome, so that their summaries (TensorBoard's HPARAMS tab) show it beside test's.
    new = {k: v for k, v in numbers.items() if k not in run.fitted or k == metrics.VAL_ACC_BEST}
    for lg in run.loggers.values():
        # A logger that takes metrics with the hyperparameters (TensorBoard: its HPARAMS tab
        # needs both at once) gets them so.
        if "metrics" in inspect.signature(lg.log_hyperparams).parameters:
            lg.log_hyperparams(
                OmegaConf.to_container(run.cfg, resolve=True),
                metrics=new,
                step=run.trainer.global_step,
            )
        else:
            lg.log_metrics(new, step=run.trainer.global_step)
        # The job's last call: Lightning's "finished" (its "success" ends each stage).
        lg.finalize("finished")
    log.info("Results: %s", json.dumps(result))
    return result


def main(cfg: DictConfig) -> float | None:
    """Hydra task function: train, return `optimized_metric` for sweepers."""
    value = train(cfg).get(cfg.optimized_metric)
    return None if value is None else float(value)
