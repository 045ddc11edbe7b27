"""Every hook the core calls on an object an extra makes: a base class each, which the extra's
class names among its bases. The core calls a hook only on an instance of its class, so a method
that merely has the name is never called, and a grep for the class finds the call and every
implementation. (Extras also subclass precision.Precision and Lightning's classes outright.)"""

from abc import ABC, abstractmethod


class BeforeRun(ABC):
    """Callback: once the Trainer, data and module are built, before anything is written, it may
    refuse the run or change the weights (training.build_run). Extras: guards.TrainerGuards,
    finetune.FineTune."""

    @abstractmethod
    def before_run(self, trainer, module) -> None: ...


class StopSignal(ABC):
    """Callback that turns a signal into Lightning's graceful stop; the command exits 128 +
    `signum` (training.fit; SIGTERM if none). Extras: reliability.SaveOnSignal."""

    signum: int | None


class ModelStateCopy(ABC):
    """Callback that saves a copy of the module's state dict in each checkpoint, under
    `model_state_key`: the module edits it as `state_dict` (ImageClassifier.on_save_checkpoint).
    Extras: speedrun.EMA (the trained weights beside the average, `current_model_state`)."""

    model_state_key: str


class FollowsCheckpoint(ABC):
    """`precision` told the mode the checkpoint a command starts from trained in, before the
    settings are checked (training, evaluation, prediction). Extras: autoprecision.AutoPrecision."""

    @abstractmethod
    def adopt(self, recorded: str | None) -> None: ...


class Float16Plugin(ABC):
    """Strategy that takes only precision plugins of its own: under 16-mixed the Trainer is built
    with the one it makes from `precision.scaler` (GradScaler's arguments) for autocast on
    `device` (Precision.trainer_args). Extras: sharding.FSDPStrategy, sharding.DeepSpeedStrategy."""

    @abstractmethod
    def float16_plugin(self, scaler: dict, device: str): ...


class JobRunner(ABC):
    """Hydra callback at `hydra.callbacks.job_runner`: cli.job runs each job through its
    `run_job(task, cfg)`, which returns what `task(cfg)` does. Extras: multirun.SweepJobs."""

    @classmethod
    @abstractmethod
    def run_job(cls, task, cfg): ...
