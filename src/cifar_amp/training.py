"""Train (then test the best checkpoint) from a composed config. `train.py` hands over here."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from cifar_amp import build, finetune, hydra_ddp, metrics, tracking
from cifar_amp.callbacks import TrainTimer
from cifar_amp.reliability import preflight, run_dirs, run_settings, signals

log = logging.getLogger(__name__)


@rank_zero_only
def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


@rank_zero_only
def save_resolved_config(cfg: DictConfig, run_dir: str) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, Path(run_dir) / "config.yaml", resolve=True)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Fit, test the best checkpoint, write `<run_dir>/metrics.json`; return those metrics."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    # Everything is built (and so range-checked) before the run dir is touched.
    prec = build.precision(cfg)
    preflight.check_hardware(cfg)
    preflight.check_fused_clipping(cfg, prec)
    layout = prec.channels_last(build.device_type(cfg))
    dm = build.datamodule(cfg, channels_last=layout)
    # A DataModule of yours need not have `meta`; predict then refuses its checkpoints.
    module = build.module(cfg, dm.num_classes, layout, getattr(dm, "meta", None))
    settings = run_settings.of(cfg)
    finetune.saved_without_pretrained(module.hparams)
    if cfg.init_from:
        finetune.init_from(cfg.init_from, module.net, dm.num_classes, cfg.ckpt_path)
    if cfg.ckpt_path and cfg.ckpt_path not in preflight.CKPT_KEYWORDS:
        run_settings.check(cfg.ckpt_path, settings)  # first: it names the setting that differs
        preflight.check_checkpoint_fits(cfg.ckpt_path, module, dm.num_classes)
    resumed = tracking.resume_kwargs(cfg)  # continue the checkpoint's MLflow / W&B runs
    callbacks, loggers = build.callbacks(cfg), build.loggers(cfg, resumed)
    timer = TrainTimer()
    callbacks += [run_settings.RecordRunSettings(settings), tracking.RecordTrackerRuns(), timer]
    with run_dirs.claim(cfg.run_dir, cfg.ckpt_path), tracking.finishing(loggers):
        save_resolved_config(cfg, cfg.run_dir)
        if cfg.ckpt_path:
            rank_zero_only(preflight.keep_previous_logs)(cfg.run_dir)
        trainer = build.trainer(cfg, prec, callbacks, loggers)
        tracking.log_config(trainer.loggers, cfg, resumed)
        return _fit_and_test(cfg, prec, trainer, module, dm, timer)


def _fit_and_test(
    cfg: DictConfig, prec, trainer: L.Trainer, module, dm, timer: TrainTimer
) -> dict[str, Any]:

    start = time.perf_counter()
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=cfg.ckpt_path)
    except SIGTERMException:  # SaveOnSignal has saved last.ckpt and said how to resume
        raise SystemExit(signals.exit_code(trainer)) from None
    fit_seconds = time.perf_counter() - start
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}

    result: dict[str, Any] = {
        metrics.PRECISION: prec.name,
        metrics.EPOCHS: trainer.current_epoch,
        metrics.FIT_SECONDS: round(fit_seconds, 3),
        metrics.TRAIN_SECONDS: round(timer.train_seconds, 3),
        metrics.VAL_ACC_BEST: fitted.get(metrics.VAL_ACC_BEST),
        **{k: fitted[k] for k in metrics.FIT_SUMMARY if k in fitted},
    }
    if module.compile:
        excess = timer.warmup_excess_seconds
        result[metrics.COMPILE_SECONDS] = None if excess is None else round(excess, 3)
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
    tracking.log_results(trainer.loggers, cfg, result, trainer.global_step)
    log.info("Results: %s", json.dumps(result))
    return result


def main(cfg: DictConfig) -> float | None:
    """Hydra task function: train, return `optimized_metric` for sweepers."""
    with hydra_ddp.job():
        result = train(cfg)
        value = result.get(cfg.optimized_metric)
        return None if value is None else float(value)
