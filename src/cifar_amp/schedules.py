"""A one-cycle learning-rate schedule planned in whole optimizer steps, for runs of any length
and for resumes that change the length. See docs/reliability.md ("Schedules")."""

from __future__ import annotations

import logging
import math
import re
import warnings
from typing import Optional

import torch
from lightning.pytorch.utilities import rank_zero_only

from cifar_amp.errors import UserError

log = logging.getLogger(__name__)


def warmup_steps(total_steps: int, pct_start: float, three_phase: bool = False) -> int:
    """Steps before the peak learning rate: torch's `pct_start * total_steps - 1` rounded to a
    whole step, at least 1, at most what leaves at least one step to anneal after the peak (and
    to come down again, with `three_phase`); 0 (start at the peak) for runs shorter than that,
    or for `pct_start=0`."""
    most = (total_steps - 2) // 2 if three_phase else total_steps - 2
    if pct_start == 0 or most < 1:
        return 0
    return min(max(1, math.floor(pct_start * total_steps + 0.5) - 1), most)


class OneCycleLR(torch.optim.lr_scheduler.OneCycleLR):
    """torch's OneCycleLR (same arguments, same shape), made safe for every run length and for
    resuming with another one. `max_lr` defaults to the optimizer's learning rate.

    - Phase boundaries are whole steps (:func:`warmup_steps`). torch places the peak at the
      fractional step `pct_start * total_steps - 1` and divides by a phase's length, which is
      zero for e.g. 4 steps at `pct_start=0.25` (ZeroDivisionError). Where `pct_start *
      total_steps` is a whole number >= 2, the learning rates are torch's.
    - Re-planned on resume: a checkpoint planned for another number of steps (a changed
      `trainer.max_epochs` or `max_steps`) continues on the schedule of a run of the new length,
      from the step it reached; a length below the steps already done is refused.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        max_lr: Optional[float] = None,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        three_phase: bool = False,
        **kwargs,
    ) -> None:
        # Set before torch's __init__, whose first step already calls get_lr.
        self.warmup_steps = warmup_steps(total_steps, pct_start, three_phase)
        self.anneal_strategy, self.three_phase = anneal_strategy, three_phase
        super().__init__(
            optimizer,
            max_lr=[g["lr"] for g in optimizer.param_groups] if max_lr is None else max_lr,
            total_steps=total_steps,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,
            three_phase=three_phase,
            **kwargs,
        )

    def get_lr(self) -> list[float]:
        step, w, last = self.last_epoch, self.warmup_steps, self.total_steps - 1
        if step > self.total_steps:
            raise ValueError(f"Tried to step {step} times; the schedule has {self.total_steps}")
        # (end step, lr from, lr to, momentum from, momentum to); each starts where the last ended
        up = (w, "initial_lr", "max_lr", "max_momentum", "base_momentum")
        if self.three_phase:
            down = (2 * w, "max_lr", "initial_lr", "base_momentum", "max_momentum")
            phases = [up, down, (last, "initial_lr", "min_lr", "max_momentum", "max_momentum")]
        else:
            phases = [up, (last, "max_lr", "min_lr", "base_momentum", "max_momentum")]
        start = 0
        for i, phase in enumerate(phases):
            if step <= phase[0] or i == len(phases) - 1:
                break
            start = phase[0]
        end, lr_from, lr_to, m_from, m_to = phase
        # A phase of no length is at its end; past the last step (the scheduler steps once
        # after the final optimizer step) the rate stays at its final value.
        pct = 1.0 if end == start else min(1.0, (step - start) / (end - start))
        lrs = []
        for group in self.optimizer.param_groups:
            lrs.append(self._anneal(group[lr_from], group[lr_to], pct))
            if self.cycle_momentum:
                m = self._anneal(group[m_from], group[m_to], pct)
                if self.use_beta1:
                    group["betas"] = (m, *group["betas"][1:])
                else:
                    group["momentum"] = m
        return lrs

    def _anneal(self, start, end, pct: float):
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2 * (math.cos(math.pi * pct) + 1)
        return start + (end - start) * pct

    def load_state_dict(self, state_dict: dict) -> None:
        planned, done = state_dict["total_steps"], state_dict["last_epoch"]
        if planned == self.total_steps:
            super().load_state_dict(state_dict)
            return
        if done > self.total_steps:
            raise UserError(
                f"trainer.max_epochs/max_steps: this run would take {self.total_steps} optimizer "
                f"steps, but the checkpoint has done {done} (its schedule was planned for "
                f"{planned}); resume with at least {done} steps, or start a new run"
            )
        if rank_zero_only.rank == 0:
            log.warning(
                "OneCycleLR: planned for %d steps, re-planned for %d (trainer.max_epochs/max_steps "
                "changed); continuing at step %d on the new plan",
                planned,
                self.total_steps,
                done,
            )
        self.last_epoch = done - 1
        with warnings.catch_warnings():
            # This fresh scheduler's first step(), before any optimizer.step(): intended here.
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
            self.step()
