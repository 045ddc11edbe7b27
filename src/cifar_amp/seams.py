"""Every hook the core calls on an object an extra makes, a base class each, whose
docstring names the extras that implement it (tests/test_seams.py checks): the core calls a hook
only on an instance of it, so a grep for the class finds the call and every implementation."""

from abc import ABC, abstractmethod


class BeforeRun(ABC):
    """A callback that, with all built and nothing written, may refuse the run or change weights.
    Implemented by: extras/finetune (FineTune), extras/guards (TrainerGuards)."""

    @abstractmethod
    def before_run(self, trainer, module) -> None: ...


class ImageData(ABC):
    """A DataModule that says what its images are: its classes' names, in label order (which
    metrics.json's per-class accuracy and the confusion picture say; the labels' numbers for a
    DataModule that does not), and the shape of an image (the layer table's FLOPs, per image).
    Implemented by: the core's CIFARDataModule, extras/image_folders (ImageFolderDataModule)."""

    @property
    @abstractmethod
    def class_names(self) -> list[str]: ...

    @property
    @abstractmethod
    def image_shape(self) -> tuple[int, int, int]: ...  # channels, height, width


def class_names(datamodule, n: int) -> list[str]:
    """The names of `datamodule`'s `n` classes, or their numbers."""
    if isinstance(datamodule, ImageData) and len(datamodule.class_names) == n:
        return list(datamodule.class_names)
    return [str(i) for i in range(n)]


class StopSignal(ABC):
    """Callback that turns a signal into Lightning's graceful stop; the process then exits with
    its `exit_code` (the command: 128 + the signal, the shell's code for it).
    Implemented by: extras/reliability (SaveOnSignal)."""

    exit_code: int


class ModelStateCopy(ABC):
    """Callback checkpointing a state-dict copy at `model_state_key`, edited as `state_dict` is.
    Implemented by: extras/speedrun (EMA)."""

    model_state_key: str


class ContinuesRun(ABC):
    """Logger whose run a resume continues: it `record`s its run in each checkpoint, and a resume
    builds it with what `resuming` finds in the checkpoint it resumes (the data, read once).
    Implemented by: extras/tracking (TrackedRun)."""

    @classmethod
    @abstractmethod
    def resuming(cls, checkpoint: dict, key: str) -> dict: ...

    @abstractmethod
    def record(self, checkpoint: dict, key: str) -> None: ...


class PrecisionMode(ABC):
    """What the core asks of the `precision` object, in build.py and training.py. The core's is
    precision.Precision, one fixed mode; an extra extends that class and overrides these.
    Implemented by: extras/auto_precision (AutoPrecision)."""

    name: str  # Lightning's name of the mode trained in, recorded in checkpoints
    channels_last: bool | None  # NHWC network and batches, decided by setup()

    @abstractmethod
    def trainer_args(self, accelerator, strategy) -> dict: ...  # `precision`, or `plugins`

    @property
    @abstractmethod
    def autocasts(self) -> bool: ...  # whether steps may run under autocast

    @abstractmethod
    def setup(self, trainer) -> None: ...  # for the Trainer's device: TF32, `channels_last`

    @abstractmethod
    def record(self) -> dict: ...  # what metrics.json says of it

    @abstractmethod
    def settle(self, accelerator, resumes: str | None = None) -> None: ...  # before `name` is read


class FollowsCheckpoint(ABC):
    """`precision`, told the mode of the checkpoint a command starts from before its check.
    Implemented by: extras/auto_precision (AutoPrecision)."""

    @abstractmethod
    def adopt(self, recorded: str | None) -> None: ...


class StrategyWithFloat16Plugin(ABC):
    """A strategy that takes only plugins of its own, so under 16-mixed it makes one from the
    GradScaler settings `precision.scaler`.
    Implemented by: extras/sharding (FSDPStrategy, DeepSpeedStrategy)."""

    @abstractmethod
    def float16_plugin(self, scaler: dict, device: str): ...


class StrategyWithoutFusedOptimizers:
    """A strategy whose parameters torch's fused optimizers cannot step, so a run with
    `module.optimizer.fused=true` is refused before anything is built on a device.
    Implemented by: extras/sharding (FSDPStrategy)."""


class JobRunner(ABC):
    """A Hydra callback at `hydra.callbacks.job_runner`, whose `run_job` cli.job runs each job by.
    Implemented by: extras/multirun (SweepJobs)."""

    @classmethod
    @abstractmethod
    def run_job(cls, task, cfg): ...
