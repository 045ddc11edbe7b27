"""Learning-rate schedules over the run's `total_steps`, for any length and resumes that change it:
one-cycle in whole steps, and cosine decay."""

import bisect
import logging
import math
import re
import warnings
from typing import Optional

import torch
from lightning.pytorch.utilities import rank_zero_only

from cifar_amp import compat
from cifar_amp.errors import UserError

log = logging.getLogger(__name__)


def warmup_steps(total_steps: int, pct_start: float, three_phase: bool = False) -> int:
    """torch's `pct_start * total_steps - 1` rounded, at least 1, leaving steps to anneal; or 0."""
    most = (total_steps - 2) // 2 if three_phase else total_steps - 2
    if pct_start == 0 or most < 1:
        return 0
    return min(max(1, math.floor(pct_start * total_steps + 0.5) - 1), most)


class Replanned:
    """A schedule over `total_steps` that a resume for another length re-plans from the step done."""

    def load_state_dict(self, state_dict: dict) -> None:
        planned, done = state_dict["total_steps"], state_dict["last_epoch"]
        if planned == self.total_steps:
            return super().load_state_dict(state_dict)
        if done > self.total_steps:
            raise UserError(
                f"trainer.max_epochs/max_steps: this run would take {self.total_steps} optimizer "
                f"steps, but the checkpoint has done {done} (its schedule was planned for "
                f"{planned}); resume with at least {done} steps, or start a new run"
            )
        if rank_zero_only.rank == 0:
            msg = "%s: planned for %d steps, re-planned for %d; continuing at step %d"
            log.warning(msg, type(self).__name__, planned, self.total_steps, done)
        self.last_epoch = done - 1
        with warnings.catch_warnings():  # this fresh scheduler's first step: before optimizer's
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
            self.step()


class OneCycleLR(Replanned, torch.optim.lr_scheduler.OneCycleLR):
    """torch's OneCycleLR in whole steps: its fractional peak divides by zero at 4 steps, 0.25."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int,
        max_lr: Optional[float] = None,
        pct_start: float = 0.3,
        three_phase: bool = False,
        **kwargs,
    ) -> None:
        # Set before torch's __init__, whose first step already calls get_lr.
        self.warmup_steps = warmup_steps(total_steps, pct_start, three_phase)
        max_lr = [g["lr"] for g in optimizer.param_groups] if max_lr is None else max_lr
        super().__init__(
            optimizer, max_lr, total_steps, pct_start=pct_start, three_phase=three_phase, **kwargs
        )

    def get_lr(self) -> list[float]:
        step, w, last = self.last_epoch, self.warmup_steps, self.total_steps - 1
        if step > self.total_steps:
            raise ValueError(f"Tried to step {step} times; the schedule has {self.total_steps}")
        phases = compat.one_cycle_phases(self)  # torch's table of each phase's ends
        ends = [w, 2 * w, last] if len(phases) == 3 else [w, last]  # on whole steps here
        i = min(bisect.bisect_left(ends, step), len(ends) - 1)
        start, end, phase = ends[i - 1] if i else 0, ends[i], phases[i]
        # A phase of no length is at its end; past the last step the rate stays at its last.
        pct = 1.0 if end == start else min(1.0, (step - start) / (end - start))
        lrs = []
        for group in self.optimizer.param_groups:
            start, end = group[phase["start_lr"]], group[phase["end_lr"]]
            lrs.append(compat.one_cycle_anneal(self, start, end, pct))
            if self.cycle_momentum:
                m_from, m_to = group[phase["start_momentum"]], group[phase["end_momentum"]]
                m = compat.one_cycle_anneal(self, m_from, m_to, pct)
                if self.use_beta1:
                    group["betas"] = (m, *group["betas"][1:])
                else:
                    group["momentum"] = m
        return lrs


class CosineAnnealingLR(Replanned, torch.optim.lr_scheduler.CosineAnnealingLR):
    """torch's cosine decay from the optimizer's rate to `eta_min` over `total_steps`, in closed
    form (torch's steps are recursive, and rise again past T_max): a resume may change the length."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, eta_min: float = 0.0):
        self.total_steps = total_steps
        super().__init__(optimizer, T_max=total_steps, eta_min=eta_min)

    def get_lr(self) -> list[float]:
        done = min(self.last_epoch, self.total_steps) / max(1, self.total_steps)
        return [
            self.eta_min + (lr - self.eta_min) * (1 + math.cos(math.pi * done)) / 2
            for lr in self.base_lrs
        ]
