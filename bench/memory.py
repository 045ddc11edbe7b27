"""Memory of a training step: measured on the device, step by step (:class:`StepWindow`); by
kind, without a device; and the largest batch that fits.

:func:`breakdown` traces two training steps of the network (its precision plugin's autocast or
dtype, cross-entropy, the configured optimizer) with torch's own `MemTracker` on fake tensors:
nothing is allocated or computed, so ResNet-18 at batch 512 takes about a second on any
machine. The bytes are those of the tensors the step creates (dtype x elements), which do not
depend on the device: CPU and CUDA autocast give conv, linear float16/bfloat16, BatchNorm,
ReLU, GELU and pooling their input's dtype, and cross-entropy float32. What a device adds on
top (data kept on the device, allocator rounding, cuDNN workspaces, the GradScaler's few
scalars) is in the measured peak only.
"""

from __future__ import annotations

import time
from typing import Callable

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from bench import compat
from cifar_amp import build

MB = 2**20
# MemTracker's kinds at the step's peak, by what the table calls them.
ACTIVATIONS = "Activation"  # kept for backward, recomputed ones included
TEMPORARIES = "Temp"  # gradients of activations, in flight during backward
BATCH = "Other"  # the input batch (registered as external)


class StepWindow:
    """The timed steps' throughput and each step's device memory. Time: one window over the
    steps after `warmup`, the device synchronised only at its two ends, so the host queues the
    next step while the device runs this one, as in training (a sync around every step would
    leave the device idle through every step's host work, Lightning's hooks most of all: the
    template then pays for them where a real run does not). Memory: the caching allocator counts
    in the host's order of calls, so no sync is needed: at a step's start it reads what is
    allocated and resets the peak, at its end it reads the peak. Over the timed steps `peak_mb`
    is the highest peak of everything on the device (weights, optimizer state, data kept on the
    device) and `step_peak_mb` what a step adds over what was allocated at its start, as
    tests/extras/resnet18/test_resnet.py measures it: the step's own peak. `base_mb` is what was allocated at the
    first timed step's start. The warm-up (cuDNN autotuning's workspaces, the optimizer state's
    creation) is in `peak_warmup_mb` only. No memory off CUDA."""

    def __init__(self, device: torch.device, warmup: int, timed: int) -> None:
        self.device, self.warmup, self.timed, self.steps = torch.device(device), warmup, timed, 0
        self.peak_mb = self.step_peak_mb = self.base_mb = self.peak_warmup_mb = None
        self.seconds: float | None = None  # the timed steps' window
        self._start = self._t0 = 0.0

    @property
    def step_seconds(self) -> float | None:
        return None if self.seconds is None else self.seconds / self.timed

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        if self.steps == self.warmup:
            self._sync()
            self._t0 = time.perf_counter()
        if self.device.type == "cuda":
            self._start = torch.cuda.memory_allocated(self.device) / MB
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> None:
        self.steps += 1
        if self.steps == self.warmup + self.timed:
            self._sync()
            self.seconds = time.perf_counter() - self._t0
        if self.device.type != "cuda":
            return
        peak = torch.cuda.max_memory_allocated(self.device) / MB
        if self.steps <= self.warmup:
            self.peak_warmup_mb = max(self.peak_warmup_mb or 0.0, peak)
            return
        if self.base_mb is None:
            self.base_mb = self._start
        self.peak_mb = max(self.peak_mb or 0.0, peak)
        self.step_peak_mb = max(self.step_peak_mb or 0.0, peak - self._start)


def breakdown(cfg: DictConfig, batch_size: int) -> dict[str, float]:
    """MB of the model state (weights, buffers, a gradient per weight, optimizer state: the
    same at any moment of a step) and, at the peak of a training step (the second one, with
    optimizer state), of the activations, activation gradients and batch."""
    FakeTensorMode, MemTracker = compat.memory_tools()

    prec = build.precision(cfg)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **prec.trainer_args("cpu", "auto"),
    )
    prec.setup(trainer)
    plugin = trainer.precision_plugin
    with FakeTensorMode():
        # The plugin's init context creates 16-bit weights directly (`true` modes); its
        # convert_module (a `.to(dtype)`) cannot swap fake parameters.
        with plugin.module_init_context():
            net = instantiate(cfg.model, num_classes=10).train()
        opt = instantiate(cfg.module.optimizer, params=net.parameters())
        x = plugin.convert_input(torch.randn(batch_size, 3, 32, 32))
        y = torch.randint(0, 10, (batch_size,))
        tracker = MemTracker()
        tracker.track_external(net, opt, x)
        with tracker:
            for step in range(2):
                with plugin.forward_context():
                    loss = torch.nn.functional.cross_entropy(net(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    tracker.reset_mod_stats()
        tensors = [*net.parameters(), *net.parameters(), *net.buffers()]  # weights twice: grads
        tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        state = sum(t.untyped_storage().nbytes() for t in tensors) / MB
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    by_kind = {getattr(k, "value", str(k)): v / MB for k, v in peak.items()}
    return {
        "state_mb": state,
        "activations_mb": by_kind.get(ACTIVATIONS, 0.0),
        "temporaries_mb": by_kind.get(TEMPORARIES, 0.0),
        "batch_mb": by_kind.get(BATCH, 0.0),
        "traced_peak_mb": by_kind["Total"],
    }


def largest_fitting(
    fits: Callable[[int], bool], guess: int, limit: int, trials: int, tol: float = 0.05
) -> tuple[int | None, int | None]:
    """(largest batch that fit, smallest that did not) after at most `trials` calls of `fits`,
    starting from `guess`: steps of x1.25 until the answer flips, then bisection until the two
    are within `tol`. None where no such batch was tried; `limit` caps the search."""
    lo, hi = None, None
    size = max(1, min(guess, limit))
    for _ in range(trials):
        if fits(size):
            lo = size
        else:
            hi = size
        if lo == limit or (hi is not None and hi <= 1):
            break
        if lo is not None and hi is not None:
            if hi - lo <= max(1, tol * lo):
                break
            size = (lo + hi) // 2
        elif hi is None:
            size = min(limit, int(size * 1.25) + 1)
        else:
            size = max(1, int(size / 1.25))
    return lo, hi
