"""A plain-PyTorch training loop: the yardstick for what Lightning costs.

It does the work that `ImageClassifier.training_step` and Lightning's automatic optimisation do,
written out by hand: the same DeviceBatches (same order and augmentation per epoch), autocast
and GradScaler as the precision plugin sets them up, zero_grad(set_to_none) -> forward ->
backward -> step -> per-step scheduler, and the epoch's loss and accuracy accumulated on the
device and read once per epoch. From the same initial weights it reaches the same weights as
the Lightning loop (bench/tests/test_speed.py), so timing both compares loops, not work.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch import nn

AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class Step:
    """One training step, as Lightning's automatic optimisation runs it: zero_grad(set_to_none)
    -> forward under autocast -> loss -> backward (scaled under 16-mixed) -> clipping of the
    unscaled gradients (if `clip`) -> optimizer step -> scheduler step. Returns the loss and the logits."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler=None,  # stepped after every optimizer step, as `interval: step` in Lightning
        precision: str = "32-true",
        label_smoothing: float = 0.0,
        scaler: torch.amp.GradScaler | None = None,  # 16-mixed only; None = a default GradScaler
        clip: float | None = None,  # the gradients' global L2 norm, unscaled, as Lightning clips
    ) -> None:
        if precision not in ("32-true", *AUTOCAST):
            raise ValueError(
                f"precision {precision!r}: the reference loop supports 32-true, 16-mixed, bf16-mixed"
            )
        self.device = next(net.parameters()).device
        self.net, self.optimizer, self.scheduler = net, optimizer, scheduler
        self.dtype, self.label_smoothing = AUTOCAST.get(precision), label_smoothing
        if precision == "16-mixed" and scaler is None:
            scaler = torch.amp.GradScaler(self.device.type)
        self.scaler, self.clip = scaler, clip

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        dtype = self.dtype
        ctx = torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with ctx:
            logits = self.net(x)
            loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            if self.clip:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            if self.clip:
                nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss, logits


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit(
    net: nn.Module,
    loader,  # DeviceBatches (anything with set_epoch and an iterator of (x, y))
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    epochs: int = 1,
    precision: str = "32-true",
    label_smoothing: float = 0.0,
    scaler: torch.amp.GradScaler | None = None,
    epoch_seconds: list[float] | None = None,  # appended: each epoch's batches, by `clock`
    clock=time.perf_counter,
) -> list[tuple[float, float]]:
    """Train `net` in place (see Step); return (mean loss, accuracy) per epoch."""
    step = Step(net, optimizer, scheduler, precision, label_smoothing, scaler)
    device = step.device
    history = []
    net.train()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        seen = 0
        sync(device)
        start = clock()
        for x, y in loader:
            loss, logits = step(x, y)
            loss_sum += loss.detach() * len(y)
            correct += (logits.detach().argmax(1) == y).sum()
            seen += len(y)
        sync(device)
        if epoch_seconds is not None:
            epoch_seconds.append(clock() - start)
        history.append(
            ((loss_sum / max(seen, 1)).item(), (correct / max(seen, 1)).item())
        )  # one sync per epoch
    return history
