"""Every hook the core calls on an object that an extra makes, one base class per hook.

An extra's class names the hook's class among its bases; the core calls the hook only on an
instance of it (`isinstance`), so a method that merely has the name is never called, and a grep
for the class name finds the core's call and every implementation. The extras also subclass the
core's `precision.Precision` (auto-precision) and Lightning's classes outright."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable


class BeforeRun(ABC):
    """A Trainer callback that may refuse the run, or change the module's weights, once the
    Trainer, data and module are built and before anything is written (training.build_run).
    Implemented by: guards.TrainerGuards, finetune.FineTune."""

    @abstractmethod
    def before_run(self, trainer, module) -> None: ...


class StopSignal(ABC):
    """A Trainer callback that turns a signal into Lightning's graceful stop (SIGTERMException);
    `signum`, the signal that stopped the run, makes the command's exit code 128 + it
    (training.fit; SIGTERM where none says). Implemented by: reliability.SaveOnSignal."""

    signum: int | None


class ModelStateCopy(ABC):
    """A Trainer callback that writes a copy of the module's state dict into each checkpoint,
    under `model_state_key` beside `state_dict`: the module edits it as it edits `state_dict`
    (module.ImageClassifier.on_save_checkpoint). Implemented by: speedrun.EMA (Lightning's
    weight averaging keeps the trained weights as `current_model_state`)."""

    model_state_key: str


class FollowsCheckpoint(ABC):
    """A `precision` told the mode that the checkpoint a command starts from trained in, before
    the run's settings are checked against it (training, evaluation; prediction).
    Implemented by: autoprecision.AutoPrecision (a resume keeps the mode its probe chose)."""

    @abstractmethod
    def adopt(self, recorded: str | None) -> None: ...


class Float16Plugin(ABC):
    """A strategy that trains only with precision plugins of its own kind: under 16-mixed the
    Trainer is built with the one it makes from `precision.scaler` (torch.amp.GradScaler's
    arguments) for autocast on a device of type `device` (precision.Precision.trainer_args).
    Implemented by: sharding.FSDPStrategy, sharding.DeepSpeedStrategy."""

    @abstractmethod
    def float16_plugin(self, scaler: dict, device: str) -> Any: ...


class JobRunner(ABC):
    """The Hydra callback configured at `hydra.callbacks.job_runner`: cli.job runs each job of
    every entry through its `run_job(task, cfg)`, which returns what `task(cfg)` returns.
    Implemented by: multirun.SweepJobs (a sweep's job fails alone)."""

    @classmethod
    @abstractmethod
    def run_job(cls, task: Callable[[Any], Any], cfg) -> Any: ...
