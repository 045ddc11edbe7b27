"""Stop a run whose training loss stays non-finite, without ever checkpointing broken weights."""

from __future__ import annotations

import logging

import torch
from lightning.pytorch import Callback

from cifar_amp.errors import UserError
from cifar_amp.reliability.signals import last_checkpoint_path

log = logging.getLogger(__name__)


class NonFiniteLossError(UserError):
    pass


class StopOnNonFiniteLoss(Callback):
    """Reports non-finite training losses with their step and stops after `patience` in a row.

    The loss is counted, not the gradients: under 16-mixed the GradScaler skips steps with
    inf gradients on its own, which is normal; a loss that stays inf/NaN is not.
    The count lives on the device and is read every `check_every` steps and before every
    checkpoint write: a read is a host sync that stalls the GPU queue, so a per-step read
    would cost throughput; the price is that a stop comes up to `check_every` steps late.
    A checkpoint is never written from non-finite weights, so last.ckpt and the best
    checkpoint stay the last good ones.
    """

    def __init__(self, patience: int = 10, check_every: int = 25) -> None:
        if patience < 1 or check_every < 1:
            raise UserError(
                f"callbacks.non_finite: patience={patience} and check_every={check_every} must be >= 1"
            )
        self.patience, self.check_every = patience, check_every
        self._run: torch.Tensor | None = None  # consecutive non-finite losses
        self._first: torch.Tensor | None = None  # step of the first one since the last read, or -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        bad = ~torch.isfinite(loss.detach())
        if self._run is None:
            self._run = torch.zeros((), dtype=torch.long, device=loss.device)
            self._first = torch.full((), -1, dtype=torch.long, device=loss.device)
        self._run = torch.where(bad, self._run + 1, 0)
        self._first = torch.where(bad & (self._first < 0), trainer.global_step, self._first)
        if trainer.global_step % self.check_every == 0:
            self._check(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # Runs before the file is written: raising here keeps the previous file.
        self._check(trainer)
        # Buffers too: BatchNorm running statistics turn NaN before any weight does.
        tensors = [
            *pl_module.parameters(),
            *(b for b in pl_module.buffers() if b.is_floating_point()),
        ]
        finite = torch.stack([t.detach().isfinite().all() for t in tensors]).all()
        if not finite:
            self._stop(trainer, f"the weights became non-finite by step {trainer.global_step}")

    def _check(self, trainer) -> None:
        if self._run is None:
            return
        run, first = (int(v) for v in torch.stack([self._run, self._first]).tolist())
        if first < 0:
            return
        self._first.fill_(-1)
        log.warning("non-finite training loss at step %d (%d consecutive so far)", first, run)
        if run >= self.patience:
            self._stop(
                trainer,
                f"the training loss was non-finite for {run} consecutive steps up to step {trainer.global_step}",
            )

    def _stop(self, trainer, what: str) -> None:
        last = last_checkpoint_path(trainer)
        kept = (
            f"the last good checkpoint is {last}" if last.is_file() else "no checkpoint was written"
        )
        raise NonFiniteLossError(
            f"{what}; stopped (callbacks.non_finite.patience={self.patience}); {kept}. "
            "Try a lower module.optimizer.lr, trainer.gradient_clip_val, or precision=32-true / bf16-mixed"
        )
