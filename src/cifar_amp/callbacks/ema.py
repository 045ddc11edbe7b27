"""An exponential moving average of the weights whose per-step update never waits for the GPU."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim.swa_utils import get_ema_multi_avg_fn


class EMA(EMAWeightAveraging):
    """Lightning's `EMAWeightAveraging` (same arguments, same schedule of updates, same
    checkpoint contents: the average in `state_dict`, the raw weights in
    `current_model_state`), updated without reading the device.

    Why not the parent's update: it calls `AveragedModel.update_parameters`, which reads the
    update count on the host twice per call (`bool(n_averaged == 0)`, `if n_averaged > 0`), each
    a device sync, and averages tensor by tensor in Python. Here whether the average holds
    weights yet is known on the host (read once per fit), the floating-point tensors are
    averaged by torch's `get_ema_multi_avg_fn` (one `_foreach_lerp_`), integer buffers
    (BatchNorm's batch counter) are copied, and the count is incremented on the device.
    """

    def __init__(self, *args, decay: float = 0.999, **kwargs) -> None:
        super().__init__(*args, decay=decay, **kwargs)
        self._lerp = get_ema_multi_avg_fn(decay)
        self._pairs: tuple | None = None  # see _split
        self._started = False  # the average holds weights (n_averaged > 0)
        self._trained: dict | None = None  # the module's own weights, once fit has ended

    @property
    def state_key(self) -> str:
        # The parent's key, so checkpoints of either class resume with the other.
        return EMAWeightAveraging.__qualname__

    def on_train_start(self, trainer, pl_module) -> None:
        # After a resume has restored n_averaged: the one host read of the fit.
        self._started = bool(self._average_model.n_averaged > 0)
        self._pairs = None
        self._trained = None

    def on_train_end(self, trainer, pl_module) -> None:
        # The parent puts the average into the module. A checkpoint written after this (the
        # step checkpointer's final last.ckpt) must still hold the trained weights as
        # `current_model_state`, or a resume that trains longer would go on from the average.
        self._trained = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._trained is not None and "current_model_state" in checkpoint:
            checkpoint["current_model_state"] = self._trained

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Only a fit goes on from the trained weights. A test or validation of a checkpoint
        # (the best one, after fit) evaluates its `state_dict`, the average, as eval.py does;
        # the parent would load the trained weights whenever it has an average model.
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # The parent's rule: step_idx is zero-based, one update per optimizer step.
        if trainer.global_step > self._latest_update_step and self.should_update(
            step_idx=trainer.global_step - 1
        ):
            self._update(pl_module)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(
            epoch_idx=trainer.current_epoch
        ):
            self._update(pl_module)
            self._latest_update_epoch = trainer.current_epoch

    @torch.no_grad()
    def _update(self, pl_module) -> None:
        average = self._average_model
        if self._pairs is None:  # the same tensors all fit long
            self._pairs = self._split(average.module, pl_module)
        avg, cur, avg_copy, cur_copy = self._pairs
        if not self._started:  # the first update starts the average at the weights
            avg_copy, cur_copy = avg + avg_copy, cur + cur_copy
            self._started = True
        elif avg:
            self._lerp(avg, self._moved(avg, cur), None)
        if avg_copy:
            torch._foreach_copy_(avg_copy, self._moved(avg_copy, cur_copy))
        average.n_averaged += 1

    def _moved(self, average: list, current: list) -> list:
        # `device=` keeps the average elsewhere (e.g. "cpu"): then each update copies, and waits.
        if self._device is None:
            return current
        return [c.to(a.device) for a, c in zip(average, current, strict=True)]

    def _split(self, average: torch.nn.Module, model: torch.nn.Module) -> tuple[list, ...]:
        """(averaged, their sources, copied, their sources): floating-point parameters (and
        buffers, with `use_buffers`) are averaged; integer buffers (BatchNorm's batch
        counter), and all buffers without `use_buffers` (as AveragedModel does), are copied."""
        params = list(zip(average.parameters(), model.parameters(), strict=True))
        buffers = list(zip(average.buffers(), model.buffers(), strict=True))
        averaged = params + buffers if self._use_buffers else params
        lerp = [(a.detach(), c.detach()) for a, c in averaged if a.is_floating_point()]
        copy = [(a.detach(), c.detach()) for a, c in params + buffers if not a.is_floating_point()]
        if not self._use_buffers:
            copy += [(a.detach(), c.detach()) for a, c in buffers if a.is_floating_point()]
        return tuple([pair[i] for pair in group] for group in (lerp, copy) for i in (0, 1))
