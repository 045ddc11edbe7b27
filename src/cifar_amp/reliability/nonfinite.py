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
    The count lives on the device. Every `check_every` steps it is copied to the host without
    waiting (CUDA: into pinned memory, behind an event) and the copy is read at the next check,
    when it has long arrived: the training step never waits for the GPU. The price is that a
    stop comes up to 2 x `check_every` steps late on a GPU (`check_every` on CPU, where the copy
    is immediate). Before every checkpoint write the count is read at once (waiting), and a
    checkpoint is never written from non-finite weights, so last.ckpt and the best checkpoint
    stay the last good ones.
    """

    def __init__(self, patience: int = 10, check_every: int = 25) -> None:
        if patience < 1 or check_every < 1:
            raise UserError(
                f"callbacks.non_finite: patience={patience} and check_every={check_every} must be >= 1"
            )
        self.patience, self.check_every = patience, check_every
        self._run: torch.Tensor | None = None  # consecutive non-finite losses
        self._first: torch.Tensor | None = None  # step of the first one since the last read, or -1
        self._copy: _HostCopy | None = None  # (run, first) on its way to the host

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
            self._check(trainer, wait=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # Runs before the file is written: raising here keeps the previous file.
        self._check(trainer, wait=True)
        # Buffers too: BatchNorm running statistics turn NaN before any weight does.
        tensors = [
            *pl_module.parameters(),
            *(b for b in pl_module.buffers() if b.is_floating_point()),
        ]
        finite = torch.stack([t.detach().isfinite().all() for t in tensors]).all()
        if not finite:
            self._stop(trainer, f"the weights became non-finite by step {trainer.global_step}")

    def _check(self, trainer, wait: bool) -> None:
        """Read the counts copied at the last check (unless still in flight), then copy the
        current ones; `wait`: read the current ones now."""
        if self._run is None:
            return
        if self._copy is not None:
            if not (wait or self._copy.arrived()):
                return  # the GPU is that far behind: look again at the next check
            self._report(trainer, self._copy)
        self._copy = _HostCopy(torch.stack([self._run, self._first]), trainer.global_step)
        self._first.fill_(-1)  # queued after the copy: the next copy starts afresh
        if wait or self._copy.event is None:
            self._report(trainer, self._copy)

    def _report(self, trainer, copy: _HostCopy) -> None:
        self._copy = None
        run, first = copy.values()
        if first < 0:
            return
        log.warning("non-finite training loss at step %d (%d consecutive so far)", first, run)
        if run >= self.patience:
            self._stop(
                trainer,
                f"the training loss was non-finite for {run} consecutive steps up to step {copy.step}",
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


class _HostCopy:
    """A small device tensor copied to the host without the host waiting for it (CUDA: pinned
    memory, non-blocking copy, an event that says when it has arrived)."""

    def __init__(self, tensor: torch.Tensor, step: int) -> None:
        self.step = step
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event() if tensor.is_cuda else None
        if self.event is not None:
            self.event.record()

    def arrived(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()  # at once when arrived(); a wait only before a checkpoint
        return self.host.tolist()
