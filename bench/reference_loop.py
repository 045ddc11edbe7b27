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

import torch
import torch.nn.functional as F
from torch import nn

AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def fit(
    net: nn.Module,
    loader,  # DeviceBatches (anything with set_epoch and an iterator of (x, y))
    optimizer: torch.optim.Optimizer,
    scheduler=None,  # stepped after every optimizer step, as `interval: step` in Lightning
    epochs: int = 1,
    precision: str = "32-true",
    label_smoothing: float = 0.0,
    scaler: torch.amp.GradScaler | None = None,  # 16-mixed only; None = a default GradScaler
) -> list[tuple[float, float]]:
    """Train `net` in place; return (mean loss, accuracy) per epoch."""
    device = next(net.parameters()).device
    dtype = AUTOCAST.get(precision)
    if precision not in ("32-true", *AUTOCAST):
        raise ValueError(
            f"precision {precision!r}: the reference loop supports 32-true, 16-mixed, bf16-mixed"
        )
    if precision == "16-mixed" and scaler is None:
        scaler = torch.amp.GradScaler(device.type)
    history = []
    net.train()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device, dtype=torch.long)
        seen = 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            ctx = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
            with ctx:
                logits = net(x)
                loss = F.cross_entropy(logits, y, label_smoothing=label_smoothing)
            if precision == "16-mixed":
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            if scheduler is not None:
                scheduler.step()
            loss_sum += loss.detach() * len(y)
            correct += (logits.detach().argmax(1) == y).sum()
            seen += len(y)
        history.append(
            ((loss_sum / max(seen, 1)).item(), (correct / max(seen, 1)).item())
        )  # one sync per epoch
    return history
