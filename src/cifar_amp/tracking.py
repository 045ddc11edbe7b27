"""Experiment trackers (the `logger` group): what every logger receives, and resumes that
continue the tracker's run.

Every logger gets the resolved config as hyperparameters before fit and the numeric values of
metrics.json at the end. The tracker's run id (MLflow run id, W&B id) is written into every
checkpoint, so whichever way a run is resumed (same run dir, a new one, after SIGTERM, a SLURM
requeue, a job of a multirun) the logger is built to continue that run, not to start one.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from cifar_amp.reliability import preflight, private

log = logging.getLogger(__name__)

KEY = "tracker_runs"  # top-level key of the checkpoint dict: {logger class name: {...}}


def _recorded(logger) -> dict[str, Any] | None:
    """What identifies this logger's run, or None for loggers whose run is their folder."""
    if isinstance(logger, MLFlowLogger):
        key, run = "run_id", logger.run_id
    elif isinstance(logger, WandbLogger):
        key, run = "id", logger.version
    else:
        return None
    return {key: run} if run else None


class RecordTrackerRuns(Callback):
    """Writes each tracker's run id into every checkpoint, under `tracker_runs`."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        runs = {type(lg).__name__: _recorded(lg) for lg in trainer.loggers}
        checkpoint[KEY] = {k: v for k, v in runs.items() if v}


def resume_source(cfg: DictConfig) -> Path | None:
    """The checkpoint this run will resume from: `ckpt_path`, Lightning's `last`/`hpc`
    keywords, or (no ckpt_path, on SLURM) the requeue checkpoint Lightning picks itself."""
    ckpt, root = cfg.get("ckpt_path"), Path(cfg.run_dir)
    if ckpt and ckpt not in preflight.CKPT_KEYWORDS:
        return Path(ckpt)
    if ckpt == "last":
        return root / "checkpoints" / "last.ckpt"
    if ckpt == "hpc" or (ckpt is None and SLURMEnvironment.detect()):
        hpc = sorted(root.glob("hpc_ckpt_*.ckpt"), key=lambda p: int(re.sub(r"\D", "", p.stem)))
        return hpc[-1] if hpc else None
    return None


def resume_kwargs(cfg: DictConfig) -> dict[str, dict[str, Any]]:
    """Config key of a logger -> the constructor arguments that continue its recorded run."""
    source = resume_source(cfg)
    if source is None or not source.is_file():
        return {}
    recorded = preflight.load_checkpoint(str(source)).get(KEY, {})
    out = {}
    for key, node in (cfg.get("logger") or {}).items():
        cls = str(node.get("_target_", "")).rsplit(".", 1)[-1] if node else ""
        run = recorded.get(cls)
        if not run:
            continue
        if cls == MLFlowLogger.__name__:
            if not _mlflow_has_run(node.get("tracking_uri"), run["run_id"]):
                log.warning(
                    "MLflow run %s of %s is not in %s: logger.%s starts a new run",
                    run["run_id"],
                    source,
                    node.get("tracking_uri"),
                    key,
                )
                continue
            out[key] = {"run_id": run["run_id"]}
        elif cls == WandbLogger.__name__:
            out[key] = {"id": run["id"], "resume": "allow"}
        log.info("Resuming: logger.%s continues run %s", key, next(iter(out[key].values())))
    return out


def _mlflow_has_run(tracking_uri: str | None, run_id: str) -> bool:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient(tracking_uri).get_run(run_id)
    except MlflowException:
        return False
    return True


def config_params(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)


def log_config(loggers: list, cfg: DictConfig, resumed: dict) -> None:
    """The resolved config, as hyperparameters, to every logger. A continued MLflow run keeps
    its params (MLflow refuses to change one); values this resume changed become tags
    `resumed/<key>`, and the run is marked running again."""
    params = config_params(cfg)
    continued = any("run_id" in kwargs for kwargs in resumed.values())
    for lg in loggers:
        if isinstance(lg, MLFlowLogger) and continued:
            _log_resumed_mlflow(lg, params)
        else:
            lg.log_hyperparams(params)


def mlflow_params(params: dict) -> dict[str, str]:
    """The params MLFlowLogger logs for `params`: flat `a/b` keys, text values (<= 250 chars)."""
    return {k: str(v)[:250] for k, v in private.flat_params(params).items()}


def _log_resumed_mlflow(lg: MLFlowLogger, params: dict) -> None:
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank != 0:
        return
    client, run_id = lg.experiment, lg.run_id
    had = client.get_run(run_id).data.params
    flat = mlflow_params(params)
    new = {k: v for k, v in flat.items() if k not in had}
    if new:
        lg.log_hyperparams(new)
    for k, v in flat.items():
        if k in had and had[k] != v:
            client.set_tag(run_id, f"resumed/{k}", v)
    client.update_run(run_id, status="RUNNING")


def log_results(loggers: list, cfg: DictConfig, result: dict[str, Any], step: int) -> None:
    """The numeric values of metrics.json to every logger, then flush and close them.
    TensorBoard gets them with the hyperparameters too: its HPARAMS tab needs both at once."""
    values = {
        k: float(v)
        for k, v in result.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    for lg in loggers:
        if isinstance(lg, TensorBoardLogger):
            lg.log_hyperparams(config_params(cfg), metrics=values, step=step)
        else:
            lg.log_metrics(values, step=step)
        lg.finalize("success")


@contextlib.contextmanager
def finishing(loggers: list):
    """End the W&B runs of `loggers` with the job, failed or not: a process runs one W&B run at
    a time, and Lightning's WandbLogger would take over a run left open (a multirun's next job)."""
    ok = False
    try:
        yield
        ok = True
    finally:
        if any(isinstance(lg, WandbLogger) for lg in loggers):
            import wandb

            if wandb.run is not None:
                wandb.finish(exit_code=0 if ok else 1)
