"""Wall time of the training loop alone: metrics.TRAIN_SECONDS and COMPILE_SECONDS."""

from __future__ import annotations

import time

import torch
from lightning import Callback

# Batches at the start of a fit that do one-off work: compilation (first forward and
# backward), cudnn autotuning, and under compile mode "reduce-overhead" the CUDA-graph
# capture, which torch makes on a later call than the first.
WARMUP_STEPS = 3


class Stopwatch:
    """Seconds while running; on CUDA each start and stop waits for the queued GPU work, so
    the time is that of the work, not of its launch (one sync per start or stop)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0: float | None = None

    @property
    def running(self) -> bool:
        return self._t0 is not None

    def start(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._t0 = time.perf_counter()

    def stop(self, device: torch.device) -> float:
        """Stop; return the seconds of this run (0 if it was not running)."""
        if self._t0 is None:
            return 0.0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        lap = time.perf_counter() - self._t0
        self.seconds += lap
        self._t0 = None
        return lap


class TrainTimer(Callback):
    """Times every training batch of the fit (its data, hooks, forward, backward, optimizer
    step), from each epoch's start to the end of its last batch; validation, and the logging
    and checkpoint writes after an epoch's last batch, are not counted.

    The first WARMUP_STEPS batches are timed apart: `train_seconds` counts them at the mean
    time of the later batches, and `warmup_excess_seconds` is what they took beyond that.
    """

    def __init__(self) -> None:
        self._warmup, self._rest = Stopwatch(), Stopwatch()
        self._steps = 0  # batches this fit
        self._device = torch.device("cpu")

    @property
    def _clock(self) -> Stopwatch:
        return self._warmup if self._steps < WARMUP_STEPS else self._rest

    def on_train_start(self, trainer, pl_module) -> None:
        self._device = pl_module.device
        self._clock.start(self._device)  # a resume mid-epoch gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if not self._clock.running:
            self._clock.start(self._device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if not self._clock.running:  # training goes on after a validation mid-epoch
            self._clock.start(self._device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._steps += 1
        if self._steps == WARMUP_STEPS:
            self._warmup.stop(self._device)
            self._rest.start(self._device)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._clock.stop(self._device)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._clock.stop(self._device)

    @property
    def _step_seconds(self) -> float | None:
        """Mean seconds of a batch after the warm-up (None if there was none)."""
        later = self._steps - WARMUP_STEPS
        return self._rest.seconds / later if later > 0 else None

    @property
    def train_seconds(self) -> float:
        step = self._step_seconds
        if step is None:  # a fit of no more batches than the warm-up: all of them, as timed
            return self._warmup.seconds
        return self._rest.seconds + WARMUP_STEPS * step

    @property
    def warmup_excess_seconds(self) -> float | None:
        step = self._step_seconds
        return None if step is None else max(0.0, self._warmup.seconds - WARMUP_STEPS * step)
