"""Lightning callbacks of the template, switched on in YAML (configs/callbacks/, experiments)."""

from cifar_amp.callbacks.checkpoint import ResumableModelCheckpoint
from cifar_amp.callbacks.curves import TrainingCurves
from cifar_amp.callbacks.ema import EMA
from cifar_amp.callbacks.precision_diagnostics import PrecisionDiagnostics
from cifar_amp.callbacks.timing import TrainTimer
from cifar_amp.callbacks.whitening import PatchWhitening

__all__ = [
    "EMA",
    "PatchWhitening",
    "PrecisionDiagnostics",
    "ResumableModelCheckpoint",
    "TrainingCurves",
    "TrainTimer",
]
