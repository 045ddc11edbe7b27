"""Extra (docs/fork.md): what mixed precision is doing to a run, and how fast it trains.

GradScaler scale and skipped steps, gradient norms and clipping, peak memory, images/s and the
training loop's seconds, logged once per epoch (so also in metrics.json); at fit start, the
precision set-up (plugin, autocast dtype and device, GradScaler settings, TF32). Per-step values
accumulate in tensors on the training device and are read once per epoch, so the training step
never waits for the device (no `.item()`, no `GradScaler.get_scale()`). Nothing in the core
imports this module.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections import Counter, defaultdict

import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, MixedPrecision
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from cifar_amp import compat as core_compat
from cifar_amp.extras.diagnostics import compat
from cifar_amp.precision import Autocast

SCALE = "precision/scale"  # GradScaler scale at epoch end (16-mixed only)
SKIPPED_STEPS = "precision/skipped_steps"  # steps skipped for inf/nan grads, since fit start
GRAD_NORM = "precision/grad_norm"  # mean L2 norm of the unscaled gradients before clipping
GRAD_NORM_MAX = "precision/grad_norm_max"
CLIP_FRACTION = "precision/clip_fraction"  # fraction of steps whose gradients clipping changed
PEAK_MEMORY_MB = "perf/peak_memory_mb"  # GPU: max allocated in the epoch; CPU: process peak RSS
IMAGES_PER_SEC = "perf/images_per_sec"  # training images per second of the epoch's training loop
# Wall time of the training loop alone, since fit start: every training batch with its data and
# hooks, from each epoch's start to the end of its last batch; not validation, nor the logging
# and checkpoint writes after an epoch's last batch. The first WARMUP_STEPS batches, which
# compile and autotune, count at the mean time of the later batches.
TRAIN_SECONDS = "train_seconds"
# With module.compile only: what those first batches took beyond that mean (the compilation of
# the training step, autotuning, CUDA-graph capture).
COMPILE_SECONDS = "compile_seconds"
# Of these, the ones that differ from run to run of the same config.
MEASURED = (PEAK_MEMORY_MB, IMAGES_PER_SEC, TRAIN_SECONDS, COMPILE_SECONDS)
# Batches at the start of a fit that do one-off work: compilation (first forward and backward),
# cudnn autotuning, and under "reduce-overhead" the CUDA-graph capture (on a later call).
WARMUP_STEPS = 3

log = logging.getLogger(__name__)


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS; it is the process peak (never reset).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class Stopwatch:
    """Seconds while running; on CUDA each start and stop waits for the queued GPU work, so the
    time is that of the work, not of its launch (one sync per start or stop)."""

    def __init__(self) -> None:
        self.seconds, self._t0 = 0.0, None

    @property
    def running(self) -> bool:
        return self._t0 is not None

    def start(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._t0 = time.perf_counter()

    def stop(self, device: torch.device) -> None:
        if self._t0 is None:
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - self._t0
        self._t0 = None


class PrecisionDiagnostics(Callback):
    """Logs the metrics above once per training epoch, and the precision set-up at fit start.

    Throughput is measured here rather than with Lightning's ThroughputMonitor because that
    calls `torch.cuda.synchronize()` after every batch; this syncs only when an epoch starts
    and ends, when validation starts, and once after the warm-up batches.
    """

    def __init__(self, probe_images: int = 8) -> None:
        self.probe_images = probe_images  # images in the fit-start autocast probe; 0 = no probe
        self._probe_pending = False
        self._skipped: Tensor | None = None  # since fit start
        self._scale_before: Tensor | None = None
        self._clock = Stopwatch()  # the fit's training loop
        self._epoch_from = 0.0  # the clock's seconds when this epoch began
        self._warmup: float | None = None  # the clock's seconds after the warm-up batches
        self._fit_steps = 0
        self._device = torch.device("cpu")
        self._params_key, self._param_list = None, []  # see _params
        self._resumed: dict | None = None  # from a checkpoint, until the first batch trains
        self._epoch = 0  # of the norms below
        self._clipping: Autocast | None = None  # the plugin whose clipping gives the norms

    # -- fit start: one line per fact ------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._skipped = torch.zeros((), device=pl_module.device)
        if self._resumed is not None:  # counted since the fit this run resumes began
            self._skipped += self._resumed["skipped"].to(pl_module.device)
        self._reset_epoch(trainer, pl_module)  # a resume mid-epoch gets no on_train_epoch_start
        rank_zero_info(f"Precision plugin: {describe(trainer)}")
        cpu = trainer.strategy.root_device.type == "cpu"
        if cpu and trainer.precision.startswith("16") and trainer.is_global_zero:
            log.warning(  # 16-mixed took 14.6x as long as 32-true on a 2-core CPU
                f"Precision: {trainer.precision} on CPU: float16 has no fast CPU kernels, so "
                "steps take many times as long as in 32-true; for speed use "
                "precision=bf16-mixed (or 32-true)"
            )
        tensors, values = Counter(), Counter()
        for p in pl_module.parameters():
            dtype = str(p.dtype).removeprefix("torch.")
            tensors[dtype] += 1
            values[dtype] += p.numel()
        counts = (
            f"{d}: {n} tensors ({values[d] / 1e6:.2f}M values)" for d, n in sorted(tensors.items())
        )
        rank_zero_info("Parameter dtypes: " + ", ".join(counts))
        clip = trainer.gradient_clip_val
        rank_zero_info(
            f"Gradient clipping: by {trainer.gradient_clip_algorithm or 'norm'} at {clip}"
            if clip
            else "Gradient clipping: off"
        )
        self._probe_pending = self.probe_images > 0
        # Clipped by norm through the core's plugin: the norm it computes is the one reported.
        plugin = trainer.precision_plugin
        by_norm = clip and trainer.gradient_clip_algorithm != "value"
        self._clipping = plugin if by_norm and isinstance(plugin, Autocast) else None
        if self._clipping is not None:
            self._clipping.clip_norms = []

    def _probe(self, trainer: Trainer, pl_module: LightningModule, x: Tensor) -> str:
        """Which module types produce which dtypes under the plugin's autocast."""
        seen: dict[str, set[str]] = defaultdict(set)

        def hook(module, _inputs, output):
            if isinstance(output, Tensor):
                seen[type(module).__name__].add(str(output.dtype).removeprefix("torch."))

        leaves = [m for m in pl_module.modules() if not next(m.children(), None)]
        handles = [m.register_forward_hook(hook) for m in leaves]
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
                pl_module(trainer.precision_plugin.convert_input(x))
        finally:
            pl_module.train(was_training)
            for h in handles:
                h.remove()
        return "; ".join(f"{name} -> {'/'.join(sorted(d))}" for name, d in sorted(seen.items()))

    # -- per step: device tensors only -------------------------------------------------------
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset_epoch(trainer, pl_module)

    def _reset_epoch(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Per step, the gradients' norm as a device tensor (and their largest value when
        # clipping by value), reduced once at epoch end: a step adds no device op but the norm.
        self._norms: list[Tensor] = []
        self._value_norms: list[Tensor] = []
        self._steps = self._images = 0  # host counters: known without asking the device
        self._epoch = trainer.current_epoch
        resumed = self._resumed
        if resumed is not None and resumed["epoch"] == trainer.current_epoch:  # mid-epoch
            self._norms = [t.to(pl_module.device) for t in resumed["norms"]]
            self._value_norms = [t.to(pl_module.device) for t in resumed["value_norms"]]
            self._steps = resumed["steps"]
        self._device = pl_module.device
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        self._epoch_from = self._clock.seconds
        if not self._clock.running:
            self._clock.start(self._device)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int
    ) -> None:
        if not self._clock.running:  # training goes on after a validation mid-epoch
            self._clock.start(self._device)
        # Probe on the first real batch: iterating the training loader ourselves would move
        # its position (part of the checkpoint) and break an exact resume.
        if self._probe_pending:
            self._probe_pending = False
            dtypes = self._probe(trainer, pl_module, batch[0][: self.probe_images])
            rank_zero_info(
                f"Autocast output dtypes (probe of {self.probe_images} images): {dtypes}"
            )

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer
    ) -> None:
        # Lightning has unscaled the gradients (16-mixed) and clips right after this hook.
        grads = [p.grad for p in self._params(optimizer) if p.grad is not None]
        if not grads:
            return
        self._steps += 1
        scaler = _scaler(trainer)
        if self._clipping is None:  # else the clipping's norm, taken by _take_clip_norms
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if scaler is not None and core_compat.optimizer_handles_unscaling(optimizer):
                # These gradients are still scaled (16-mixed unscales them for clipping after
                # this hook: precision.py's Autocast).
                norm = norm / compat.scale(scaler)
            self._norms.append(norm)
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            self._value_norms.append(torch.nn.utils.get_total_norm(grads, float("inf")))
        if scaler is not None and compat.scale(scaler) is not None:
            self._scale_before = compat.scale(scaler).clone()

    def _params(self, optimizer) -> list[Tensor]:
        # The optimizer's parameters, listed again only when it or its groups change (fine-tuning
        # adds a group when it unfreezes layers); from step to step only their `.grad` changes.
        key = (optimizer, len(optimizer.param_groups))
        if self._params_key != key:
            self._params_key = key
            self._param_list = [p for g in optimizer.param_groups for p in g["params"]]
        return self._param_list

    def _take_clip_norms(self) -> None:
        """The norms the plugin's clipping computed since the last call, in step order."""
        if self._clipping is not None and self._clipping.clip_norms:
            self._norms.extend(self._clipping.clip_norms)
            self._clipping.clip_norms.clear()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        self._take_clip_norms()
        self._resumed = None
        self._images += len(batch[0])
        self._fit_steps += 1
        if self._fit_steps == WARMUP_STEPS:  # the warm-up is timed apart (one sync)
            self._clock.stop(self._device)
            self._warmup = self._clock.seconds
            self._clock.start(self._device)
        if self._scale_before is not None:
            # GradScaler.update() lowers the scale exactly when the step was skipped for inf/nan.
            self._skipped += compat.scale(trainer.precision_plugin.scaler) < self._scale_before
            self._scale_before = None

    # -- resume: the epoch in progress, so that a run resumed mid-epoch logs what an
    # uninterrupted one does (without, its epoch's norms were those of the steps after the
    # resume: bench.kill_campaign). Times, images/s and memory are measured, not resumed.
    def state_dict(self) -> dict:
        self._take_clip_norms()  # a checkpoint may be written before this batch's end hook
        return {
            "epoch": self._epoch,
            "norms": list(self._norms),
            "value_norms": list(self._value_norms),
            "steps": self._steps,
            "skipped": self._skipped if self._skipped is not None else torch.zeros(()),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self._resumed = state_dict

    # -- validation (and the checkpoints after it) inside fit is not training time -------------
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._clock.stop(self._device)

    # -- once per epoch: read everything -------------------------------------------------------
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock.stop(self._device)

        def log(name: str, value) -> None:
            pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=False)

        self._take_clip_norms()
        if self._steps and self._norms:  # none where a module's own clipping skipped the plugin
            norms = torch.stack(self._norms).float()
            finite = torch.isfinite(norms)
            safe, count = torch.where(finite, norms, 0.0), finite.sum()
            nan = torch.full_like(count, float("nan"), dtype=norms.dtype)
            log(GRAD_NORM, torch.where(count > 0, safe.sum() / count.clamp_min(1), nan))
            log(GRAD_NORM_MAX, safe.max())
            if clip := trainer.gradient_clip_val:
                if trainer.gradient_clip_algorithm == "value":
                    changed = torch.stack(self._value_norms).float() > clip
                else:  # torch.nn.utils.clip_grad_norm_ rescales iff clip / (norm + 1e-6) < 1
                    changed = norms + 1e-6 > clip
                log(CLIP_FRACTION, (changed & finite).sum() / self._steps)
        scaler = _scaler(trainer)
        if scaler is not None and compat.scale(scaler) is not None:
            log(SCALE, compat.scale(scaler).float().reshape(()))
            log(SKIPPED_STEPS, self._skipped)
        cuda = self._device.type == "cuda"
        log(
            PEAK_MEMORY_MB,
            torch.cuda.max_memory_allocated(self._device) / 2**20 if cuda else peak_rss_mb(),
        )
        if (seconds := self._clock.seconds - self._epoch_from) > 0:
            log(IMAGES_PER_SEC, self._images / seconds)
        later = self._fit_steps - WARMUP_STEPS
        if later <= 0:  # a fit of no more batches than the warm-up: all of them, as timed
            log(TRAIN_SECONDS, self._clock.seconds)
            return
        step = (self._clock.seconds - self._warmup) / later
        log(TRAIN_SECONDS, self._clock.seconds - self._warmup + WARMUP_STEPS * step)
        if getattr(pl_module, "hparams", {}).get("compile"):
            log(COMPILE_SECONDS, max(0.0, self._warmup - WARMUP_STEPS * step))


def _scaler(trainer: Trainer):
    plugin = trainer.precision_plugin
    scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
    return scaler if scaler is not None and scaler.is_enabled() else None


def describe(trainer: Trainer) -> str:
    """One line: the precision plugin in use, its autocast dtype and device, the GradScaler's
    settings, and on CUDA whether float32 runs on TF32 cores."""
    return describe_plugin(trainer) + _tf32(trainer.strategy.root_device)


def describe_plugin(trainer: Trainer) -> str:
    """One line: the precision plugin in use, its autocast dtype and scaler settings."""
    plugin = trainer.precision_plugin
    mixed = getattr(plugin, "precision", None) in ("16-mixed", "bf16-mixed")
    if not (mixed and isinstance(plugin, (MixedPrecision, FSDPPrecision, DeepSpeedPrecision))):
        return f"{trainer.precision}: {type(plugin).__name__}, no autocast, no GradScaler"
    dtype = "bfloat16" if plugin.precision == "bf16-mixed" else "float16"
    if isinstance(plugin, DeepSpeedPrecision):
        return (
            f"{plugin.precision}: DeepSpeed's {dtype} engine and loss scaler (DeepSpeedPrecision)"
        )
    # FSDP autocasts on CUDA only (and gathers its sharded parameters in `dtype`)
    device = getattr(plugin, "device", "cuda")
    text, sc = (
        f"{plugin.precision}: {dtype} autocast on {device} ({type(plugin).__name__})",
        plugin.scaler,
    )
    if sc is None or not sc.is_enabled():
        return text + (", no GradScaler" if sc is None else ", GradScaler disabled")
    return (
        f"{text}, {type(sc).__name__}(init_scale={sc.get_scale():g}, "
        f"growth_factor={sc.get_growth_factor():g}, backoff_factor={sc.get_backoff_factor():g}, "
        f"growth_interval={sc.get_growth_interval()})"
    )


def _tf32(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "; TF32 n/a (needs Ampere or newer)"
    if torch.backends.cuda.matmul.allow_tf32:
        return "; TF32 on (float32 convolutions and matmuls; precision.tf32=false: strict)"
    return "; TF32 off (strict IEEE float32)"
