"""What mixed precision is doing to a run: GradScaler scale and skipped steps, gradient
norms and clipping, peak memory and throughput; plus, at fit start, the precision set-up.

Per-step values accumulate in tensors on the training device and are read once per epoch,
so the hot path never waits for the device (no `.item()`, no `GradScaler.get_scale()`).
"""

from __future__ import annotations

import resource
import sys
from collections import Counter, defaultdict

import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from cifar_amp import metrics as M
from cifar_amp.callbacks.timing import Stopwatch
from cifar_amp.precision import describe_plugin
from cifar_amp.reliability import private


def _scaler(trainer: Trainer):
    plugin = trainer.precision_plugin
    scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
    return scaler if scaler is not None and scaler.is_enabled() else None


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS; it is the process peak (never reset).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class PrecisionDiagnostics(Callback):
    """Logs metrics.SCALE, SKIPPED_STEPS, GRAD_NORM(_MAX), CLIP_FRACTION, PEAK_MEMORY_MB and
    IMAGES_PER_SEC once per training epoch.

    Throughput is measured here rather than with Lightning's ThroughputMonitor because that
    calls `torch.cuda.synchronize()` after every batch; this syncs only when an epoch starts
    and ends and when validation starts (callbacks/timing.py). It counts the training loop
    only (validation, and the checkpoints written after it, excluded).
    """

    def __init__(self, probe_images: int = 8) -> None:
        self.probe_images = probe_images  # images in the fit-start autocast probe; 0 = no probe
        self._skipped: Tensor | None = None  # since fit start
        self._scale_before: Tensor | None = None
        self._clock = Stopwatch()  # the epoch's training loop
        self._probe_pending = False

    # -- fit start: one line per fact ----------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._skipped = torch.zeros((), device=pl_module.device)
        self._reset_epoch(pl_module)  # a resume mid-epoch gets no on_train_epoch_start
        rank_zero_info(f"Precision plugin: {describe_plugin(trainer)}")
        tensors, values = Counter(), Counter()
        for p in pl_module.parameters():
            dtype = str(p.dtype).removeprefix("torch.")
            tensors[dtype] += 1
            values[dtype] += p.numel()
        rank_zero_info(
            "Parameter dtypes: "
            + ", ".join(
                f"{d}: {n} tensors ({values[d] / 1e6:.2f}M values)"
                for d, n in sorted(tensors.items())
            )
        )
        clip = trainer.gradient_clip_val
        rank_zero_info(
            f"Gradient clipping: by {trainer.gradient_clip_algorithm} at {clip}"
            if clip
            else "Gradient clipping: off"
        )
        self._probe_pending = self.probe_images > 0

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int
    ) -> None:
        if not self._clock.running:  # training goes on after a validation mid-epoch
            self._clock.start(pl_module.device)
        # Probe on the first real batch: iterating the training loader ourselves would move
        # its position (part of the checkpoint) and break an exact resume.
        if self._probe_pending:
            self._probe_pending = False
            dtypes = self._probe(trainer, pl_module, batch[0][: self.probe_images])
            rank_zero_info(
                f"Autocast output dtypes (probe of {self.probe_images} images): {dtypes}"
            )

    def _probe(self, trainer: Trainer, pl_module: LightningModule, x: Tensor) -> str:
        seen: dict[str, set[str]] = defaultdict(set)

        def hook(module, _inputs, output):
            if isinstance(output, Tensor):
                seen[type(module).__name__].add(str(output.dtype).removeprefix("torch."))

        leaves = [m for m in pl_module.modules() if not next(m.children(), None)]
        handles = [m.register_forward_hook(hook) for m in leaves]
        x = trainer.precision_plugin.convert_input(x)
        # Eval mode + no_grad: the probe must not move BatchNorm statistics or build a graph;
        # neither changes which dtype autocast picks for an op. Eager, so that a compiled
        # network is not compiled once more for the probe's batch.
        was_training = pl_module.training
        pl_module.eval()
        try:
            with (
                torch.no_grad(),
                torch.compiler.set_stance("force_eager"),
                trainer.precision_plugin.forward_context(),
            ):
                pl_module(x)
        finally:
            pl_module.train(was_training)
            for h in handles:
                h.remove()
        return "; ".join(f"{name} -> {'/'.join(sorted(d))}" for name, d in sorted(seen.items()))

    # -- per step: device tensors only ----------------------------------------------
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset_epoch(pl_module)

    def _reset_epoch(self, pl_module: LightningModule) -> None:
        zero = torch.zeros((), device=pl_module.device)
        self._norm_sum, self._norm_max, self._finite, self._clipped = (
            zero.clone(),
            zero.clone(),
            zero.clone(),
            zero.clone(),
        )
        self._steps = self._images = 0  # host counters: known without asking the device
        self._cuda = pl_module.device.type == "cuda"
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._clock = Stopwatch()
        self._clock.start(pl_module.device)

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer
    ) -> None:
        # Lightning has unscaled the gradients (16-mixed) and clips right after this hook.
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if not grads:
            return
        self._steps += 1
        norm = torch.nn.utils.get_total_norm(grads, 2.0).float()
        scaler = _scaler(trainer)
        if scaler is not None and private.optimizer_unscales(optimizer):
            # A fused optimizer unscales inside its step, so these gradients are still scaled
            # (and Lightning refuses clipping with it under 16-mixed: see preflight.py).
            norm = norm / private.scale_tensor(scaler)
        finite = torch.isfinite(norm)
        safe = torch.where(finite, norm, 0.0)
        self._norm_sum += safe
        torch.maximum(self._norm_max, safe, out=self._norm_max)
        self._finite += finite
        clip = trainer.gradient_clip_val
        if clip:
            if trainer.gradient_clip_algorithm == "value":
                changed = torch.nn.utils.get_total_norm(grads, float("inf")).float() > clip
            else:  # torch.nn.utils.clip_grad_norm_ rescales iff clip / (norm + 1e-6) < 1
                changed = norm + 1e-6 > clip
            self._clipped += changed & finite
        if scaler is not None and private.scale_tensor(scaler) is not None:
            self._scale_before = private.scale_tensor(scaler).clone()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        self._images += len(batch[0])
        if self._scale_before is not None:
            # GradScaler.update() lowers the scale exactly when the step was skipped for inf/nan.
            self._skipped += (
                private.scale_tensor(trainer.precision_plugin.scaler) < self._scale_before
            )
            self._scale_before = None

    # -- validation (and the checkpoints after it) inside fit is not training time --------
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._clock.stop(pl_module.device)

    # -- once per epoch: read everything -------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock.stop(pl_module.device)

        def log(name: str, value) -> None:
            pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=False)

        if self._steps:
            nan = torch.full_like(self._norm_sum, float("nan"))
            log(
                M.GRAD_NORM,
                torch.where(self._finite > 0, self._norm_sum / self._finite.clamp_min(1), nan),
            )
            log(M.GRAD_NORM_MAX, self._norm_max)
            if trainer.gradient_clip_val:
                log(M.CLIP_FRACTION, self._clipped / self._steps)
        scaler = _scaler(trainer)
        if scaler is not None and private.scale_tensor(scaler) is not None:
            log(M.SCALE, private.scale_tensor(scaler).float().reshape(()))
            log(M.SKIPPED_STEPS, self._skipped)
        peak = (
            torch.cuda.max_memory_allocated(pl_module.device) / 2**20
            if self._cuda
            else peak_rss_mb()
        )
        log(M.PEAK_MEMORY_MB, float(peak))
        if self._clock.seconds > 0:
            log(M.IMAGES_PER_SEC, self._images / self._clock.seconds)
