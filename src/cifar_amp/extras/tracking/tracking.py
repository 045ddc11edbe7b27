"""Extra (docs/fork.md): MLflow and W&B runs that a resume continues, however it resumes
(src/cifar_amp/extras/tracking/README.md): each run id rides in every checkpoint (`TRACKERS`),
through the core's seams.ContinuesRun. Nothing in the core imports this module; configs/logger/
name these classes."""

from __future__ import annotations

import logging
from pathlib import Path

from lightning.pytorch import loggers
from lightning.pytorch.utilities import rank_zero_only

from cifar_amp import seams
from cifar_amp.extras.tracking import compat

try:  # reads checkpoints of the template's earlier releases; a fork may delete it
    from cifar_amp.extras.tracking import releases
except ImportError:
    releases = None

log = logging.getLogger(__name__)
TRACKERS = "tracker_runs"  # the checkpoint's {logger config key: run id}


def mlflow_params(params: dict) -> dict[str, str]:
    """The params MLFlowLogger logs for `params` (flat `a/b` keys, text values <= 250 chars),
    by Lightning's own flattening (compat.flat_params), so that a continued run knows which it has."""
    return {k: str(v)[:250] for k, v in compat.flat_params(params).items()}


class TrackedRun(seams.ContinuesRun):
    """A logger whose run id (`version`) goes into every checkpoint, and whose constructor takes
    `version=` the run to continue: a resume, however it resumes, continues that run."""

    @classmethod
    def resuming(cls, checkpoint: dict, key: str) -> dict:
        runs = checkpoint.get(TRACKERS, {})
        if not isinstance(run := runs.get(key), str):  # none, or an earlier release's
            run = releases and releases.tracker_run(runs, cls)
        if not run:
            return {}
        log.info("Resuming: logger.%s continues run %s", key, run)
        return {"version": run}

    def record(self, checkpoint: dict, key: str) -> None:
        if self.version:
            checkpoint.setdefault(TRACKERS, {})[key] = self.version


class MLFlowLogger(loggers.MLFlowLogger, TrackedRun):
    """Lightning's MLFlowLogger; `version`: the run to continue (where the store still has it)."""

    def __init__(self, *args, version: str | None = None, **kwargs) -> None:
        from filelock import FileLock
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        self.continued = False
        uri = kwargs.get("tracking_uri")
        if uri and uri.startswith("sqlite:///"):
            # The default store's path is relative: taken from the working directory (where every
            # job of a sweep starts), its folder made, as SQLite does not make it.
            db = Path(uri.removeprefix("sqlite:///")).expanduser().resolve()
            db.parent.mkdir(parents=True, exist_ok=True)
            kwargs["tracking_uri"] = uri = f"sqlite:///{db}"
            # Parallel jobs that start together would each create the store's tables or the
            # experiment, and all but one fail: one at a time, the others find them made.
            with FileLock(uri.removeprefix("sqlite:///") + ".lock"):
                client, name = MlflowClient(uri), kwargs.get("experiment_name", "lightning_logs")
                if client.get_experiment_by_name(name) is None:
                    client.create_experiment(name, kwargs.get("artifact_location"))
        if version and not kwargs.get("run_id"):
            try:
                MlflowClient(uri).get_run(version)
                kwargs["run_id"], self.continued = version, True
            except MlflowException:
                log.warning("MLflow run %s is not in %s: a new run starts", version, uri)
        super().__init__(*args, **kwargs)

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        """A continued run keeps its params (MLflow refuses to change one); values this resume
        changed become tags `resumed/<key>`, and the run is marked running again."""
        if not self.continued:
            return super().log_hyperparams(params)
        client, run_id = self.experiment, self.run_id
        had = client.get_run(run_id).data.params
        flat = mlflow_params(params)
        if new := {k: v for k, v in flat.items() if k not in had}:
            super().log_hyperparams(new)
        for k, v in flat.items():
            if k in had and had[k] != v:
                client.set_tag(run_id, f"resumed/{k}", v)
        client.update_run(run_id, status="RUNNING")


class WandbLogger(loggers.WandbLogger, TrackedRun):
    """Lightning's WandbLogger (`version`: the W&B id), whose run ends with the job, or a
    multirun's next job would take it over: at `finalize("finished")` (the core's last call,
    Lightning's before a SLURM requeue) or a failure; "success" only ends a stage."""

    def finalize(self, status: str) -> None:
        super().finalize(status)
        import wandb

        if status != "success" and wandb.run is not None and wandb.run.id == self.version:
            wandb.finish(exit_code=0 if status == "finished" else 1)


class TensorBoardLogger(loggers.TensorBoardLogger):
    """Lightning's TensorBoardLogger, whose HPARAMS tab shows the run's final numbers with its
    config: the metrics the core logs last (training.report, before `finalize("finished")`) go
    with the hyperparameters logged first."""

    _last: tuple[dict, int | None] = ({}, None)

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        # finalize's log_hyperparams passes the same dict on to here: written once is enough
        if metrics is not self._last[0]:
            self._last = (metrics, step)
            super().log_metrics(metrics, step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if status == "finished" and self._last[0]:
            super().log_hyperparams(self.hparams, metrics=self._last[0], step=self._last[1])
        super().finalize(status)
