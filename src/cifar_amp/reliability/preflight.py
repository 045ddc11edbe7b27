"""Checks that refuse a run before any data is read or step taken: hardware the config asks
for, checkpoints that cannot be resumed from, run dirs that would be overwritten."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from omegaconf import OmegaConf

from cifar_amp.build import device_type
from cifar_amp.errors import UserError

# Lightning's own keywords for `ckpt_path` (resolved by the Trainer, not files).
CKPT_KEYWORDS = ("last", "hpc")


def check_hardware(cfg) -> None:
    """What Lightning itself would not refuse, or only mid-run: more CPU processes than cores,
    bf16 on a GPU without it, DDP in a single CPU process. (A missing GPU or more GPUs than
    there are, Lightning refuses on its own, in one line.)"""
    t, device = cfg.trainer, device_type(cfg)
    precision_name = cfg.precision.name
    wanted = t.devices
    if isinstance(wanted, str) and wanted.strip().lstrip("-").isdigit():
        wanted = int(wanted)
    have = os.cpu_count() or 1
    if device == "cpu" and isinstance(wanted, int) and wanted > have:
        raise UserError(
            f"trainer.devices={wanted}: only {have} CPU core(s) here; valid: 1..{have}, -1 (all) or auto"
        )
    if (
        device == "cuda"
        and precision_name.startswith("bf16")
        and not torch.cuda.is_bf16_supported()
    ):
        name = torch.cuda.get_device_name()
        raise UserError(
            f"precision={precision_name}: {name} has no bfloat16 support; valid here: 16-mixed, 32-true, 16-true"
        )
    one_process = wanted in (1, "auto") and t.num_nodes == 1
    if device == "cpu" and t.strategy.startswith("ddp") and one_process:
        raise UserError(
            f"trainer.strategy={t.strategy} with trainer.devices={t.devices} on CPU is a single process, so there is "
            "nothing to distribute; use trainer=ddp_cpu (2 processes), trainer.devices=N, or trainer.strategy=auto"
        )


def check_fused_clipping(cfg, prec) -> None:
    """A fused optimizer unscales the gradients inside its own step, so under mixed precision
    they cannot be clipped before it (Lightning's MixedPrecision would stop at the first step,
    in bf16-mixed too)."""
    clip = cfg.trainer.get("gradient_clip_val")
    fused = OmegaConf.select(cfg, "module.optimizer.fused", default=None)
    if clip and fused and prec.name in ("16-mixed", "bf16-mixed"):
        raise UserError(
            f"trainer.gradient_clip_val={clip} with module.optimizer.fused=true under "
            f"precision={prec.name}: the fused optimizer unscales the gradients inside its step, "
            "so they cannot be clipped before it; drop one of the two (32-true clips with it)"
        )


def load_checkpoint(path: str, key: str = "ckpt_path") -> dict:
    """The checkpoint at `path` (the config's `key`), or a one-line error for a missing,
    truncated or foreign file."""
    if not Path(path).is_file():
        valid = f", or one of {CKPT_KEYWORDS}" if key == "ckpt_path" else ""
        raise UserError(f"{key}={path}: no such file (valid: a .ckpt file{valid})")
    try:  # mmap: reads only the index now, tensors on demand
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # zip/pickle errors of a truncated or foreign file
        raise UserError(
            f"{key}={path} is truncated or not a checkpoint ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise UserError(f"{key}={path} is not a Lightning checkpoint (no 'state_dict')")
    return ckpt


def check_checkpoint_fits(path: str, module: torch.nn.Module, num_classes: int) -> None:
    """Refuse a checkpoint from another network or number of classes, naming the keys that differ."""
    ckpt = load_checkpoint(path)
    theirs = ckpt.get("hyper_parameters", {}).get("num_classes")
    if theirs is not None and theirs != num_classes:
        raise UserError(
            f"ckpt_path={path} was trained for {theirs} classes; data.dataset has {num_classes}"
        )
    saved, ours = ckpt["state_dict"], module.state_dict()
    problems = []
    if missing := sorted(set(ours) - set(saved)):
        problems.append(f"missing from the checkpoint: {few(missing)}")
    if extra := sorted(set(saved) - set(ours)):
        problems.append(f"not in this model: {few(extra)}")
    shapes = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}"
        for k, v in ours.items()
        if k in saved and saved[k].shape != v.shape
    ]
    if shapes:
        problems.append(f"shapes (checkpoint vs model): {few(shapes)}")
    if problems:
        raise UserError(
            f"ckpt_path={path} does not fit this model (check model=...): " + "; ".join(problems)
        )


def few(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def check_run_dir(run_dir: str, ckpt_path: str | None) -> None:
    """A run dir that already holds a run is only reused to resume it."""
    root = Path(run_dir)
    if not (root / "config.yaml").exists():  # written by every run at its start
        return
    if ckpt_path or (SLURMEnvironment.detect() and any(root.glob("hpc_ckpt_*.ckpt"))):
        return  # resuming (Lightning resumes SLURM requeues from hpc_ckpt_*.ckpt itself)
    raise UserError(
        f"run dir {run_dir} already holds a run; resume it with ckpt_path={root / 'checkpoints' / 'last.ckpt'} "
        "or pick a new hydra.run.dir"
    )


def keep_previous_logs(run_dir: str) -> None:
    """Before a resume in the same run dir: Lightning's CSVLogger deletes an existing
    metrics.csv when it starts, so move it aside (metrics.1.csv, ...) to keep the logs of the
    interrupted part."""
    old = Path(run_dir) / "metrics.csv"
    if not old.is_file():
        return
    n = 1
    while (kept := old.with_name(f"metrics.{n}.csv")).exists():
        n += 1
    old.rename(kept)
