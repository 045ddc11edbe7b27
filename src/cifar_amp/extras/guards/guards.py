"""Extra (docs/fork.md): trainer settings that Lightning would accept but that would not do what
was asked are refused on one line, before the run writes anything: a device that is not here,
more CPU processes than cores, a DDP run of one process on CPU, several devices under a strategy
of one, ranks that a script would restart per stage, bfloat16 on a GPU without it, 16-mixed
under Lightning's DeepSpeed, a negative clip value or accumulation. Without it, Lightning's own
behaviour (or its one-line refusal) applies."""

import os

import torch
from hydra.core.hydra_config import HydraConfig
from lightning import Callback
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

from cifar_amp.build import per_stage_ranks
from cifar_amp.errors import UserError
from cifar_amp.seams import BeforeRun


class TrainerGuards(Callback, BeforeRun):
    def __init__(self, accelerator: str = "auto", devices="auto", strategy="auto") -> None:
        """The `trainer.*` settings (the config passes them); a missing device is refused now,
        before Lightning builds the Trainer: its refusal would not name the recipe that chose it."""
        self.devices, self.strategy = devices, strategy
        names = ("cuda", "mps") if accelerator == "gpu" else (str(accelerator),)
        found = [AcceleratorRegistry[n]["accelerator"] for n in names if n in AcceleratorRegistry]
        if found and not any(a.is_available() for a in found):
            raise UserError(
                f"{_chosen_by()} needs a {accelerator} device (trainer.accelerator={accelerator})"
                " and none is visible here; to run it on this machine's CPU add trainer=cpu (or "
                "trainer=ddp_cpu: 2 processes)"
            )

    def before_run(self, trainer, pl_module) -> None:
        if (start := per_stage_ranks(self.strategy)) and not HydraConfig.initialized():
            raise UserError(  # a command starts them once (build.trainer); a script cannot
                f"trainer.strategy={self.strategy}: ranks started by {start} restart for fit and"
                " test, losing the CSV log and epoch count; run train.py, or trainer.strategy=ddp here"
            )
        for key, value, least in (
            ("gradient_clip_val", trainer.gradient_clip_val, 0),  # Lightning: no clipping
            ("accumulate_grad_batches", trainer.accumulate_grad_batches, 1),
        ):
            if value is not None and value < least:
                raise UserError(
                    f"invalid config value for trainer.{key}: {value}; must be >= {least}"
                )
        _precision(trainer)
        cores, cpu = os.cpu_count() or 1, trainer.strategy.root_device.type == "cpu"
        asked = f"trainer.devices={self.devices}"
        if cpu and trainer.num_devices > cores:
            raise UserError(
                f"{asked}: only {cores} CPU core(s) here; valid: 1..{cores}, -1 or auto"
            )
        if cpu and isinstance(trainer.strategy, DDPStrategy) and trainer.world_size == 1:
            raise UserError(
                f"trainer.strategy={self.strategy} with {asked} on CPU is a single process; use "
                "trainer=ddp_cpu (2 processes), trainer.devices=N or trainer.strategy=auto"
            )
        if _count(self.devices) > 1 and trainer.num_devices == 1:  # Lightning: one, silently
            raise UserError(
                f"{asked} with trainer.strategy={self.strategy}: that strategy runs on one "
                "device; use trainer.strategy=ddp (or auto) for several, or trainer.devices=1"
            )


def _precision(trainer) -> None:
    """bfloat16 where the GPU has none (autocast would fall back to float32 with a warning), and
    the core's 16-mixed plugin under Lightning's DeepSpeed, whose engine bypasses it."""
    name, device = trainer.precision, trainer.strategy.root_device
    if device.type == "cuda" and "bf16" in name and not torch.cuda.is_bf16_supported():
        raise UserError(
            f"precision={name}: {torch.cuda.get_device_name(device)} has no bfloat16 "
            "support; valid here: 16-mixed, 32-true, 16-true"
        )
    if isinstance(trainer.strategy, DeepSpeedStrategy):
        if isinstance(trainer.precision_plugin, MixedPrecision):
            raise UserError(
                f"precision={name} with {type(trainer.strategy).__name__} would lose "
                "precision.scaler; use trainer=deepspeed (the sharding extra), or bf16-mixed"
            )


def _chosen_by() -> str:
    """The option that set the device, for a user who did not know it: recipe, else trainer."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    picked = [(g, choices.get(g)) for g in ("experiment", "trainer")]
    return next((f"{g}={c}" for g, c in picked if c not in (None, "default")), "this run")


def _count(devices) -> int:
    """How many devices `trainer.devices` names (2, "2", [0, 1], "0,1"); 0 for auto, -1."""
    if isinstance(devices, (list, tuple)) or "," in str(devices):
        return len([d for d in str(devices).strip("[]()").split(",") if d.strip()])
    return int(devices) if str(devices).strip().isdigit() else 0
