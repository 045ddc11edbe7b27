"""`precision=auto`: the fastest precision mode whose loss stays finite, on this device, for
this network and batch, chosen by a probe when fit starts.

Candidates, by device (`candidates`), each 16-bit mode only where the device runs its type
natively (`precision.native`): elsewhere it is emulated, many times slower than float32 (CPU
bfloat16 10x on an AVX2 CPU, float16 45x on a Sapphire Rapids without AMX-FP16), so probing
it would only spend the budget.
- CUDA: `32-true` (TF32 as `precision.tf32` says), `bf16-mixed` where the GPU has bfloat16
  (Ampere or newer), `16-mixed`.
- CPU: `32-true`; `bf16-mixed` where oneDNN has native bfloat16 kernels (AVX512-BF16 / AMX),
  `16-mixed` where it has float16 training kernels (AMX-FP16).
- Any other device: `32-true`.

The probe (`probe`) trains a copy of the module per candidate on the first training batch
(the run's batch size and layout) as the run will train it (`_Candidate`): the optimizer and
schedule of the module's `configure_optimizers` (fused where configured), the candidate's
autocast and GradScaler (`precision.scaler`), the run's gradient clipping (`unscale_` first, as
Lightning does it), and no host read inside a step: the device is waited for at the two ends
of a window of WINDOW steps only, as in training, where the host's work on a step overlaps the
device's on the one before, and a step that reads the device (GradScaler's inf check with a
non-fused optimizer) pays for it. On one H200 the previous probe, one step at a time with a
wait after each, found 16-mixed 5% faster than bf16-mixed, while the template's own steps ran
bf16-mixed 1.35x faster (docs/benchmarks-gpu.md). Not in it: Lightning's loop and the run's
callbacks (their per-step work has side effects: checkpoints, logs, an EMA copy), the same in
every mode; `make bench-gpu` checks the choice against the template's own steps. One untimed
warm-up step each (cuDNN autotuning, oneDNN kernel creation), then timed windows in turn (A, B,
A, B, ...: a busy machine slows every candidate alike) until `precision.probe_seconds` is spent
or each has timed MAX_TIMED_STEPS steps.
Where two steps of each candidate would not fit that budget (a GPU-sized network and batch on a
CPU), it probes on the batch's first images only, as many as fit (a warm pilot step of 16
images each says how many), and says so; metrics.json records the images it probed with. It
runs eager (before `module.compile` compiles the network) and leaves the run's module, loader
position and random state as they were. `choose` rejects every candidate whose loss was not
finite and takes the fastest of the rest by its fastest window; a candidate within 5% of the
fastest wins if it is the more precise (32-true, then bf16-mixed, then 16-mixed), since the
probe's few steps cannot tell 5% apart on a busy machine. Under DDP every rank probes and rank
0's choice is used.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Annotated, Callable, Optional

import torch
from lightning import Callback, LightningModule
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.plugins import precision as plugins
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor

from cifar_amp import compat as core_compat
from cifar_amp.config import Nested
from cifar_amp.errors import InvalidArgument, UserError
from cifar_amp.extras.auto_precision import compat
from cifar_amp.precision import NAMES, Precision, native, start_momentum
from cifar_amp.seams import FollowsCheckpoint, PrecisionMode

log = logging.getLogger(__name__)
AUTO = "auto"
SAFEST_FIRST = ("32-true", "bf16-mixed", "16-mixed")
MARGIN = 1.05  # a safer candidate this close to the fastest wins
MAX_TIMED_STEPS = 20  # per candidate, whatever the budget: enough for a steady fastest window
WINDOW = 5  # steps timed together, the device waited for at the window's ends only
# metrics.json keys of the probe: PRECISION_PROBE/<mode> = a candidate's images/s (null: loss not
# finite); PRECISION_PROBE_BATCH = the images of each probe step (the run's batch)
PRECISION_PROBE, PRECISION_PROBE_BATCH = "precision_probe", "precision_probe/batch"


@dataclass
class Measured:
    """One candidate's probe: its seconds a step in each window, whether every loss was finite."""

    seconds: list[float] = field(default_factory=list)
    finite: bool = True
    batch_size: int = 0

    @property
    def images_per_sec(self) -> float:
        # Of the fastest window: on a busy machine other processes only ever add time.
        return self.batch_size / min(self.seconds) if self.seconds else 0.0


def candidates(device_type: str, bf16: bool, fp16: bool) -> list[str]:
    """The modes auto may pick on a device of this type with these capabilities: `bf16` and
    `fp16`, whether the device runs bfloat16 / float16 natively (precision.native)."""
    if device_type not in ("cuda", "cpu"):
        return ["32-true"]
    return ["32-true", *(["bf16-mixed"] if bf16 else []), *(["16-mixed"] if fp16 else [])]


def choose(measured: dict[str, Measured]) -> str:
    """The fastest candidate whose loss stayed finite (a more precise one within MARGIN of it
    wins); `32-true` if none stayed finite."""
    speed = {k: m.images_per_sec for k, m in measured.items() if m.finite and m.seconds}
    if not speed:
        return "32-true"
    best = max(speed.values())
    ranked = sorted(speed, key=lambda k: SAFEST_FIRST.index(k) if k in SAFEST_FIRST else 99)
    return next(k for k in ranked if speed[k] * MARGIN >= best)


def probe(
    module,
    batch,
    names: list[str],
    plugin: Callable[[str], object],
    device: torch.device,
    budget: float,
    clip: tuple[float | None, object] = (None, None),
) -> dict[str, Measured]:
    """Train a copy of `module` on `batch` in each mode of `names` (`plugin(name)`: its
    precision plugin; `clip`: the run's gradient_clip_val and algorithm) for at most about
    `budget` seconds in all; see the module doc."""
    cuda = device.type == "cuda"
    rng = torch.random.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None
    deadline = time.perf_counter() + budget
    runs = {name: _Candidate(module, plugin(name), device, clip) for name in names}
    try:
        batch, step = _fitting(batch, runs, deadline)  # step: a step's seconds, if stepped
        out = {name: Measured(batch_size=len(batch[0])) for name in names}
        for name, run in runs.items():  # warm-up, at this batch size (unless the pilot's)
            if name not in step:
                step[name], out[name].finite = run.window(batch, 1)
        timed, stepped = dict.fromkeys(names, 0), True
        while stepped:  # a window of each candidate in turn, while it fits the budget
            stepped = False
            for name, run in runs.items():
                fit = (deadline - time.perf_counter()) / step[name] if step[name] else WINDOW
                steps = min(WINDOW, MAX_TIMED_STEPS - timed[name], int(fit))
                if steps < 1 and not timed[name]:  # one step late, not a candidate unranked
                    steps = 1
                if steps < 1:
                    continue
                step[name], finite = run.window(batch, steps)
                out[name].seconds.append(step[name])
                out[name].finite &= finite
                timed[name] += steps
                stepped = True
    finally:
        del runs
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.set_rng_state(rng[1], device)
        torch.random.set_rng_state(rng[0])
    return out


def _fitting(batch, runs: dict, deadline: float, pilot: int = 16) -> tuple[list, dict]:
    """(`batch`, or its first images where two steps of every candidate at full size would not
    fit the budget (a CPU with a GPU-sized network and batch); each candidate's seconds a step
    at that size where it has stepped warm at it already, the pilot's). Sized by a warm pilot step of each candidate on `pilot`
    images, taking step time as proportional to the images (which overestimates, since part of
    a step does not grow with the batch). A candidate's first step is no measure: it loads
    kernels, autotunes cuDNN and makes the optimizer's state, which on an H100 took longer than
    a whole warm step at the run's batch of 512 and shrank the probe to 16 images, timing the
    host instead of the GPU."""
    size = len(batch[0])
    if size <= pilot:
        return batch, {}
    small = [t[:pilot] for t in batch]
    for run in runs.values():
        run.window(small, 1)  # the one-time costs
    warm = {name: run.window(small, 1)[0] for name, run in runs.items()}
    fits = int(0.8 * (deadline - time.perf_counter()) / (2 * sum(warm.values()) / pilot))
    if fits >= size:
        return batch, {}
    return [t[: max(pilot, fits)] for t in batch], warm if fits <= pilot else {}


class _Candidate:
    """A copy of the module trained in one mode as the run trains it: the optimizer and
    schedule of its `configure_optimizers` (fused or not, as configured), the plugin's
    autocast and GradScaler, the run's clipping through the plugin (after `unscale_`, as
    Lightning's automatic optimisation does it), in the layout of the module and batch;
    `window` times steps without a host read between them, as training runs them."""

    def __init__(self, module, plugin, device: torch.device, clip=(None, None)) -> None:
        self.plugin, self.device = plugin, device
        self.module = copy.deepcopy(module).to(device).train()  # without its Trainer
        self.optimizer, self.scheduler = _optimizers(self.module)
        self.scaler = getattr(plugin, "scaler", None)
        self.clip_val, self.clip_algorithm = clip[0] or 0.0, clip[1] or GradClipAlgorithmType.NORM

    def step(self, batch) -> Tensor:
        """One training step, the loss (left on the device)."""
        optimizer, scaler = self.optimizer, self.scaler
        optimizer.zero_grad(set_to_none=True)
        with self.plugin.forward_context():
            out = self.module.training_step(self.plugin.convert_input(batch), 0)
        loss = out["loss"] if isinstance(out, dict) else out
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None and not core_compat.optimizer_handles_unscaling(optimizer):
            scaler.unscale_(optimizer)
        if self.clip_val > 0:  # 16-mixed's plugin unscales a fused optimizer's gradients first
            self.plugin.clip_gradients(optimizer, self.clip_val, self.clip_algorithm)
        if scaler is None:
            optimizer.step()
        else:  # as Autocast.optimizer_step: fused SGD's momentum set before a skipped first step
            if core_compat.optimizer_handles_unscaling(optimizer):
                start_momentum(optimizer)
            scaler.step(optimizer)
            scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss.detach()

    def window(self, batch, steps: int) -> tuple[float, bool]:
        """(seconds a step over `steps` steps, whether every loss was finite): the device waited
        for at the window's two ends only, where training never waits."""
        self._sync()
        start = time.perf_counter()
        losses = [self.step(batch) for _ in range(steps)]
        finite = bool(torch.stack(losses).isfinite().all())  # the window's one host read
        self._sync()
        return (time.perf_counter() - start) / steps, finite

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _optimizers(module) -> tuple[torch.optim.Optimizer, object]:
    """The optimizer and first scheduler of `module.configure_optimizers()` (a plain SGD where
    it has none), the schedule sized for a long run (its rate matters, not its values)."""
    if type(module).configure_optimizers is LightningModule.configure_optimizers:
        return torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-3), None
    module.trainer = SimpleNamespace(estimated_stepping_batches=10_000)  # what it may ask
    try:
        returned = module.configure_optimizers()
        optimizers, schedulers = compat.optimizers_and_schedulers(returned)
    finally:
        module.trainer = None
    return optimizers[0], schedulers[0]["scheduler"] if schedulers else None


def first_batch(trainer):
    """The first training batch, on the training device, from a fresh training loader of the
    run's DataModule (train.py always has one)."""
    if trainer.datamodule is None:
        raise UserError("precision=auto probes the first batch of a DataModule: fit with one")
    batch = next(iter(trainer.datamodule.train_dataloader()))
    return move_data_to_device(batch, trainer.strategy.root_device)


class AutoPrecision(Precision, PrecisionMode, FollowsCheckpoint):
    """`precision=auto` (its configs/precision/auto.yaml): a Precision whose mode is chosen by the
    probe when fit starts, or taken from the checkpoint a run resumes (no probe). It overrides
    the PrecisionMode hooks, and Precision's own plugin and channels_last_on, which they call.

    Args:
        probe_seconds: the probe's budget, all candidates together.
        scaler, channels_last, tf32: as Precision's; channels_last null = on, on CUDA and
            CPU: every candidate's faster layout (on CUDA within 2% of NCHW for 32-true in
            strict fp32, the one exception), the probe timing each candidate in it.
    """

    def __init__(
        self,
        name: str = AUTO,
        scaler: Annotated[Optional[dict], Nested(torch.amp.GradScaler, ("device",))] = None,
        channels_last: Optional[bool] = None,
        tf32: bool = True,
        probe_seconds: float = 20.0,
    ) -> None:
        if name != AUTO:
            raise InvalidArgument(
                "name",
                repr(name),
                "precision=auto chooses it; for a fixed mode use precision=<mode>",
            )
        if not probe_seconds > 0:
            raise InvalidArgument("probe_seconds", probe_seconds, "must be > 0")
        super().__init__("32-true", scaler, channels_last, tf32)
        self.name, self.probe_seconds = AUTO, probe_seconds
        self.probed: dict[str, float | None] = {}  # images/s per candidate (None: rejected)
        self.probe_batch: int | None = None  # the images of each probe step

    def trainer_args(self, accelerator, strategy) -> dict:
        # The chosen mode's plugin is installed at fit start (use).
        if self.name == AUTO:
            return {"precision": "32-true"}
        return super().trainer_args(accelerator, strategy)

    @property
    def autocasts(self) -> bool:
        return self.name == AUTO or super().autocasts

    def channels_last_on(self, device: str) -> bool:
        setting = self.channels_last_setting
        return setting if setting is not None else device in ("cuda", "cpu")

    def adopt(self, recorded: str | None) -> None:
        if self.name == AUTO and recorded in NAMES:
            self.name = recorded
            log.info("Precision auto: %s, as chosen by the run resumed (no probe)", recorded)

    def record(self) -> dict:
        if not self.probed:  # chosen by the run resumed
            return super().record()
        probed = {f"{PRECISION_PROBE}/{k}": v for k, v in self.probed.items()}
        return super().record() | probed | {PRECISION_PROBE_BATCH: self.probe_batch}

    def setup(self, trainer) -> None:
        strategy = type(trainer.strategy)
        if issubclass(strategy, (FSDPStrategy, DeepSpeedStrategy)):
            # the probe trains plain copies of the network on one device, not sharded ones
            raise UserError(
                f"precision=auto does not probe under {strategy.__name__}; choose a mode: "
                "precision=bf16-mixed, 16-mixed or 32-true"
            )
        super().setup(trainer)  # its log line: "Precision: auto, ..." until the probe chooses
        if self.name == AUTO:
            trainer.callbacks.append(Probe(self))

    def plugin(self, device: str, name: str | None = None) -> plugins.Precision:
        """Mode `name`'s plugin (default: the chosen mode's): each candidate's in the probe."""
        if (name := name or self.name) in ("16-mixed", "bf16-mixed"):
            return super().plugin(device, name)
        return plugins.Precision()

    def use(self, trainer, name: str) -> None:
        """Run the rest of the fit in mode `name` (before the strategy's set-up)."""
        self.name = name
        trainer.strategy.precision_plugin = self.plugin(trainer.strategy.root_device.type, name)
        log.info("Precision: %s, chosen at fit start", name)


class Probe(Callback):
    """Added by `AutoPrecision.setup`: probes when fit sets up (the data is loaded, the model
    not yet compiled, moved or wrapped), then installs the chosen mode's plugin, for the
    strategy's set-up to connect."""

    def __init__(self, precision: AutoPrecision) -> None:
        self.precision = precision

    def setup(self, trainer, pl_module, stage: str) -> None:
        prec = self.precision
        if prec.name != AUTO:  # chosen by an earlier fit of this Trainer
            return
        if stage != "fit":  # nothing to train: the safe mode
            prec.use(trainer, "32-true")
            return
        device = trainer.strategy.root_device
        names = candidates(device.type, *native(device.type))
        start, batch = time.perf_counter(), first_batch(trainer)
        measured = probe(
            pl_module,
            batch,
            names,
            lambda name: prec.plugin(device.type, name),
            device,
            prec.probe_seconds,
            (trainer.gradient_clip_val, trainer.gradient_clip_algorithm),
        )
        chosen = trainer.strategy.broadcast(choose(measured), src=0)
        prec.probed = {k: m.images_per_sec if m.finite else None for k, m in measured.items()}
        prec.probe_batch = next(iter(measured.values())).batch_size
        if prec.probe_batch < len(batch[0]):
            log.warning(
                "Precision auto: probed on %d of the batch's %d images: two steps of each "
                "candidate at the full batch would not fit precision.probe_seconds=%g",
                prec.probe_batch,
                len(batch[0]),
                prec.probe_seconds,
            )
        seen = ", ".join(
            f"{k} {m.images_per_sec:,.0f} images/s" + ("" if m.finite else " (loss not finite)")
            for k, m in measured.items()
        )
        log.info(
            "Precision auto: probe of %s, batch %d, %.1f s: %s -> %s",
            type(getattr(pl_module, "net", pl_module)).__name__,
            prec.probe_batch,
            time.perf_counter() - start,
            seen,
            chosen,
        )
        prec.use(trainer, chosen)
