"""Train, then test the best checkpoint, from a composed config. `train.py` hands over here."""

import contextlib
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from cifar_amp import build, evaluation, lean_module, metrics, resume, runs, seams
from cifar_amp.checkpoints import Checkpoint
from cifar_amp.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Run:
    cfg: DictConfig
    precision: seams.PrecisionMode
    trainer: L.Trainer
    datamodule: L.LightningDataModule
    module: L.LightningModule
    resumed: Checkpoint | None  # the checkpoint this run continues, read once
    fit_seconds: float | None = None
    fitted: dict = field(default_factory=dict)  # what fit logged (last values)


def train(cfg: DictConfig) -> dict:
    """Fit, test the best checkpoint, write `<run_dir>/metrics.json`; return those metrics."""
    run = build_run(cfg)
    with holding_run_dir(run):
        record_config(run)
        fit(run)
        return report(run, test(run))


def build_run(cfg: DictConfig) -> Run:
    """Everything the run needs, range-checked, and the resume checked; nothing is written yet."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    resumed = resume.start(cfg)  # the checkpoint this run continues, read once
    prec = build.precision(cfg, resumed)
    loggers = build.loggers(cfg, resumed and resumed.data)
    callbacks = build.callbacks(cfg)
    trainer = build.trainer(cfg, prec, callbacks, loggers.values())  # sets prec.channels_last
    dm = build.datamodule(cfg, prec.channels_last)
    module = build.module(cfg, dm.num_classes, prec.channels_last)
    lean_module.attach(trainer, module)
    trainer.callbacks.append(resume.check(cfg, resumed, prec, module, dm.num_classes, loggers))
    # A callback may still refuse the run, or change the weights, while nothing is written.
    for cb in (cb for cb in callbacks if isinstance(cb, seams.BeforeRun)):
        cb.before_run(trainer, module)
    return Run(cfg, prec, trainer, dm, module, resumed)


@contextlib.contextmanager
def holding_run_dir(run: Run):
    """Hold the run dir while the run writes there; a file it cannot write stops the run in one
    line, which names the checkpoint to resume from."""
    with runs.claim(run.cfg.run_dir, resuming=run.resumed is not None):
        try:
            yield
        except runs.WriteFailed as e:
            last = Path(run.cfg.run_dir) / "checkpoints" / "last.ckpt"
            good = last if last.is_file() else run.resumed and run.resumed.path
            then = f"resume with ckpt_path={good} once there is room" if good else None
            raise UserError(f"{e}; {then or 'no checkpoint has been written yet'}") from e


def record_config(run: Run) -> None:
    """The resolved config, in the run dir (config.yaml) and in every logger."""
    runs.save_config(run.cfg)
    for lg in run.trainer.loggers:
        lg.log_hyperparams(OmegaConf.to_container(run.cfg, resolve=True))


def fit(run: Run) -> None:
    start, ckpt = time.perf_counter(), run.resumed and run.resumed.path
    trust = run.cfg.trust_checkpoint
    try:
        run.trainer.fit(run.module, run.datamodule, ckpt_path=ckpt, weights_only=not trust)
    except SIGTERMException:  # exit as a shell reports a signal, with a StopSignal's code
        said = [cb.exit_code for cb in run.trainer.callbacks if isinstance(cb, seams.StopSignal)]
        raise SystemExit(next(iter(said), 128 + signal.SIGTERM)) from None
    run.fit_seconds = round(time.perf_counter() - start, 3)
    fitted = {k: float(v) for k, v in run.trainer.callback_metrics.items()}
    run.fitted = lean_module.logged_before_resume(run.trainer) | fitted


def test(run: Run) -> dict:
    """Test the best checkpoint (the final weights where there is none)."""
    if not run.cfg.test:
        return {}
    cb = run.trainer.checkpoint_callback
    if not (ckpt := cb and cb.best_model_path):
        log.warning("No best checkpoint (no validation?): testing the final weights")
    run.trainer.test(run.module, run.datamodule, ckpt_path=ckpt or None, weights_only=True)
    return evaluation.tested(run.trainer) | {metrics.TESTED_CKPT: ckpt or None}


def report(run: Run, test_metrics: dict) -> dict:
    """`<run_dir>/metrics.json`, and its numbers to every logger, whose run then ends."""
    fitted, step = run.fitted, run.trainer.global_step
    head = {metrics.EPOCHS: run.trainer.current_epoch, metrics.FIT_SECONDS: run.fit_seconds}
    best_key = metrics.best(run.cfg.monitor.metric)
    best = {best_key: fitted.get(best_key)}  # null without validation, or where not logged
    result = runs.write_metrics(
        run.cfg, run.precision.record() | head | best | fitted | test_metrics
    )
    # Every logger gets the numbers that fit did not log, a sweep's objective among them.
    numbers = {k: v for k, v in result.items() if type(v) in (int, float)}
    new = {k: v for k, v in numbers.items() if k not in fitted or k == best_key}
    for lg in run.trainer.loggers:
        lg.log_metrics(new, step=step)
        lg.finalize("finished")  # the job's last call (Lightning's "success" ends each stage)
    return result


def main(cfg: DictConfig) -> float | None:  # for sweepers: `optimized_metric`
    value = train(cfg).get(cfg.optimized_metric)
    return None if value is None else float(value)
