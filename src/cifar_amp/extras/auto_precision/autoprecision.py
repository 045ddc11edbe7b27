"""`precision=auto`: the fastest precision mode whose loss stays finite, on this device, for
this network and batch, chosen by a probe when fit starts.

Candidates, by device (`candidates`):
- CUDA: `32-true` (TF32 as `precision.tf32` says), `bf16-mixed` where the GPU has bfloat16
  (Ampere or newer), `16-mixed`.
- CPU: `32-true` and `bf16-mixed`; `16-mixed` only where oneDNN has native float16 kernels
  (AVX512-FP16 / AMX-FP16): elsewhere CPU float16 autocast is emulated, 14.6x slower than
  float32 on the maintainers' CPU, so probing it would only spend the budget.
- Any other device: `32-true`.

The probe (`probe`) trains a copy of the module per candidate, each with its own optimizer and
precision plugin, on the first training batch (the run's batch size and layout): one untimed
warm-up step each (cuDNN autotuning, oneDNN kernel creation), then timed steps in turn (A, B, A,
B, ...: a busy machine slows every candidate alike) until `precision.probe_seconds` is spent.
Where two steps of each candidate would not fit that budget (a GPU-sized network and batch on a
CPU), it probes on the batch's first images only, as many as fit (a warm pilot step of 16
images each says how many), and says so; metrics.json records the images it probed with. It
runs eager (before `module.compile` compiles the network) and leaves the run's module, loader
position and random state as they were. `choose` rejects every candidate whose loss was not finite and takes the
fastest of the rest by its fastest step; a candidate within 5% of the fastest wins if it is the
more precise (32-true, then bf16-mixed, then 16-mixed), since the probe's few steps cannot
tell 5% apart on a busy machine. Under DDP every rank probes and rank 0's choice is used.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Annotated, Callable, Optional

import torch
from hydra.utils import instantiate
from lightning import Callback
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.plugins import precision as plugins
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from cifar_amp.config import Nested
from cifar_amp.errors import InvalidArgument, UserError
from cifar_amp.precision import NAMES, Precision
from cifar_amp.seams import FollowsCheckpoint

log = logging.getLogger(__name__)
AUTO = "auto"
SAFEST_FIRST = ("32-true", "bf16-mixed", "16-mixed")
MARGIN = 1.05  # a safer candidate this close to the fastest wins
MAX_TIMED_STEPS = 20  # per candidate, whatever the budget: enough for a steady fastest step
# metrics.json keys of the probe: PRECISION_PROBE/<mode> = a candidate's images/s (null: loss not
# finite); PRECISION_PROBE_BATCH = the images of each probe step (the run's batch)
PRECISION_PROBE, PRECISION_PROBE_BATCH = "precision_probe", "precision_probe/batch"


@dataclass
class Measured:
    """One candidate's probe: its step times (s) and whether every loss was finite."""

    seconds: list[float] = field(default_factory=list)
    finite: bool = True
    batch_size: int = 0

    @property
    def images_per_sec(self) -> float:
        # Of the fastest step: on a busy machine other processes only ever add time.
        return self.batch_size / min(self.seconds) if self.seconds else 0.0


def candidates(device_type: str, bf16: bool, fp16: bool) -> list[str]:
    """The modes auto may pick on a device of this type with these capabilities: `bf16` and
    `fp16`, whether the device runs bfloat16 / float16 natively (CPU: float16 only)."""
    if device_type == "cuda":
        return ["32-true", *(["bf16-mixed"] if bf16 else []), "16-mixed"]
    if device_type == "cpu":
        return ["32-true", "bf16-mixed", *(["16-mixed"] if fp16 else [])]
    return ["32-true"]


def capabilities(device: torch.device) -> tuple[bool, bool]:
    """(bf16, fp16) of `device`, for `candidates`."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False), True
    if device.type == "cpu":
        # Private: oneDNN's own test for native float16 kernels; no public API says it.
        native_fp16 = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
        return True, bool(native_fp16())
    return False, False


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
) -> dict[str, Measured]:
    """Train a copy of `module` on `batch` in each mode of `names` (`plugin(name)`: its
    precision plugin) for at most about `budget` seconds in all; see the module doc."""
    cuda = device.type == "cuda"
    rng = torch.random.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None
    deadline = time.perf_counter() + budget
    runs = {name: _Candidate(module, plugin(name), device) for name in names}
    try:
        batch, warm = _fitting(batch, runs, deadline)
        out = {name: Measured(batch_size=len(batch[0])) for name in names}
        for name, run in runs.items():  # warm-up, at this batch size (unless the pilot's)
            out[name].finite &= warm or run.step(batch)[1]
        stepped = True
        while stepped:  # each candidate in turn, while its next step fits the budget
            stepped = False
            for name, run in runs.items():
                m = out[name]
                if len(m.seconds) >= MAX_TIMED_STEPS or (
                    m.seconds and time.perf_counter() + m.seconds[-1] > deadline
                ):
                    continue
                seconds, finite = run.step(batch)
                m.seconds.append(seconds)
                m.finite &= finite
                stepped = True
    finally:
        del runs
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.set_rng_state(rng[1], device)
        torch.random.set_rng_state(rng[0])
    return out


def _fitting(batch, runs: dict, deadline: float, pilot: int = 16) -> tuple[list, bool]:
    """(`batch`, or its first images where two steps of every candidate at full size would not
    fit the budget (a CPU with a GPU-sized network and batch); whether every candidate has
    stepped at that size already). Sized by a warm pilot step of each candidate on `pilot`
    images, taking step time as proportional to the images (which overestimates, since part of
    a step does not grow with the batch). A candidate's first step is no measure: it loads
    kernels, autotunes cuDNN and makes the optimizer's state, which on an H100 took longer than
    a whole warm step at the run's batch of 512 and shrank the probe to 16 images, timing the
    host instead of the GPU."""
    size = len(batch[0])
    if size <= pilot:
        return batch, False
    small = [t[:pilot] for t in batch]
    for run in runs.values():
        run.step(small)  # the one-time costs
    per_image = sum(run.step(small)[0] for run in runs.values()) / pilot
    fits = int(0.8 * (deadline - time.perf_counter()) / (2 * per_image))
    if fits >= size:
        return batch, False
    return [t[: max(pilot, fits)] for t in batch], fits <= pilot


class _Candidate:
    """A copy of the module with its own optimizer (the module's `optimizer` config where it
    has one) and precision plugin; `step` = one timed training step."""

    def __init__(self, module, plugin, device: torch.device) -> None:
        self.plugin, self.device = plugin, device
        self.module = copy.deepcopy(module).to(device).train()  # without its Trainer
        config = getattr(module, "hparams", {}).get("optimizer")
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = (
            instantiate(config, params=params)
            if isinstance(config, dict) and "_target_" in config
            else torch.optim.SGD(params, lr=1e-3)
        )
        self.scaler = getattr(plugin, "scaler", None)

    def step(self, batch) -> tuple[float, bool]:
        self._sync()
        start = time.perf_counter()
        with self.plugin.forward_context():
            out = self.module.training_step(self.plugin.convert_input(batch), 0)
        loss = out["loss"] if isinstance(out, dict) else out
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        finite = torch.isfinite(loss.detach()).item()
        self._sync()
        return time.perf_counter() - start, finite

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def first_batch(trainer):
    """The first training batch, on the training device, from a fresh training loader."""
    dm = trainer.datamodule
    # Private: where the Trainer keeps loaders given to fit() directly (no DataModule).
    loader = dm.train_dataloader() if dm is not None else trainer.fit_loop._data_source.dataloader()
    batch = next(iter(loader))
    return move_data_to_device(batch, trainer.strategy.root_device)


class AutoPrecision(Precision, FollowsCheckpoint):
    """`precision=auto` (its configs/precision/auto.yaml): a Precision whose mode is chosen by the
    probe when fit starts, or taken from the checkpoint a run resumes (no probe).

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

    def channels_last(self, device: str) -> bool:
        return self._channels_last if self._channels_last is not None else device in ("cuda", "cpu")

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
        names = candidates(device.type, *capabilities(device))
        start, batch = time.perf_counter(), first_batch(trainer)
        measured = probe(
            pl_module,
            batch,
            names,
            lambda name: prec.plugin(device.type, name),
            device,
            prec.probe_seconds,
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
