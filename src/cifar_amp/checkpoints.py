"""Checkpoints: each read once per command, as data only, and what they say: the settings a
resume must keep, whether the network fits, the trackers' runs, what the network expects.

Why data only: unpickling can run any code, and checkpoints are shared (predict, export,
fine-tuning). torch's `weights_only` loader takes tensors, containers, numbers and strings,
plus the types of SAFE_TYPES; every checkpoint the template writes, now or in earlier
releases, holds nothing else. `trust_checkpoint=true` lifts the rule for a file you trust.
"""

from __future__ import annotations

import inspect
import logging
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback

from cifar_amp.errors import InvalidArgument, UserError
from cifar_amp.module import ImageClassifier

log = logging.getLogger(__name__)

KEYWORDS = ("last", "hpc")  # Lightning's own values of ckpt_path, resolved by resume_source()
SETTINGS = "run_settings"  # top-level keys the template adds to every checkpoint
TRACKERS = "tracker_runs"
TRUST = "trust_checkpoint"  # the config key that lifts the data-only rule
# Types beyond plain data that a template checkpoint may hold. None today: Lightning keeps
# hyperparameters as dicts, torchmetrics and the GradScaler keep tensors and numbers, and the
# template converts its config to plain containers before it saves any.
SAFE_TYPES: list = []


def load(path: str | Path, key: str = "ckpt_path", trust: bool = False) -> dict:
    """The checkpoint dict at `path` (the config's `key`), or a one-line UserError: a missing,
    truncated or foreign file, or one that holds anything but data (unless `trust`)."""
    if not Path(path).is_file():
        valid = f", or one of {', '.join(KEYWORDS)}" if key == "ckpt_path" else ""
        raise UserError(f"{key}={path}: no such file (valid: a .ckpt file{valid})")
    try:  # mmap: reads only the index now, tensors on demand
        with torch.serialization.safe_globals(SAFE_TYPES):
            ckpt = torch.load(path, map_location="cpu", weights_only=not trust, mmap=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise UserError(f"{key}={path} is truncated or not a checkpoint ({e})") from e
        found = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(path)) or str(e)
        raise UserError(
            f"{key}={path} holds {found}, which no checkpoint of this template holds: not "
            f"loaded, since unpickling it could run code. If you trust the file: {TRUST}=true"
        ) from None
    except Exception as e:  # zip errors of a truncated or foreign file
        raise UserError(
            f"{key}={path} is truncated or not a checkpoint ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise UserError(f"{key}={path} is not a Lightning checkpoint (no 'state_dict')")
    return ckpt


def few(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def mismatch(saved: dict, ours: dict, head_ok=lambda k, a, b: False) -> tuple[list[str], list[str]]:
    """(problems, heads): how state dict `saved` differs from `ours` (missing keys, extra keys,
    shapes), leaving out the tensors `head_ok(key, saved, ours)` accepts, which are listed apart."""
    problems, heads = [], []
    if missing := sorted(set(ours) - set(saved)):
        problems.append(f"missing from the checkpoint: {few(missing)}")
    if extra := sorted(set(saved) - set(ours)):
        problems.append(f"not in this model: {few(extra)}")
    shapes = []
    for k, v in ours.items():
        if k in saved and saved[k].shape != v.shape:
            if head_ok(k, saved[k], v):
                heads.append(k)
            else:
                shapes.append(f"{k} {tuple(saved[k].shape)} vs {tuple(v.shape)}")
    if shapes:
        problems.append(f"shapes (checkpoint vs model): {few(shapes)}")
    return problems, heads


def run_settings(cfg) -> dict[str, Any]:
    """The values a resume must keep, by the config key a user would change: the schedule, the
    loader's position in batches and the optimizer and GradScaler state mean nothing with others."""
    return {
        "data.dataset": cfg.data.get("dataset", cfg.data._target_),
        "data.batch_size": cfg.data.get("batch_size"),
        "precision": cfg.precision.name,
        "model._target_": cfg.model["_target_"],
    }


class Checkpoint:
    """A checkpoint file, read once, and what it says."""

    def __init__(self, path: str | Path, key: str = "ckpt_path", trust: bool = False) -> None:
        self.path, self.key = str(path), key
        self.data = load(path, key, trust)
        self.hparams: dict = self.data.get("hyper_parameters", {})
        self.settings: dict = self.data.get(SETTINGS, {})  # older checkpoints have none

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Refuse to continue with other settings, naming the first that differs."""
        for key, theirs in self.settings.items():
            if key in settings and settings[key] != theirs:
                raise UserError(
                    f"{self.key}={self.path} was trained with {key}={theirs}; this run asks for "
                    f"{key}={settings[key]}. A resume must keep {', '.join(settings)}: resume "
                    f"with {key}={theirs}, or start a new run"
                )

    def check_fits(self, module, num_classes: int) -> None:
        """Refuse another number of classes or another network, naming the keys that differ."""
        theirs = self.hparams.get("num_classes")
        if theirs is not None and theirs != num_classes:
            raise UserError(
                f"{self.key}={self.path} was trained for {theirs} classes; data.dataset has {num_classes}"
            )
        problems, _ = mismatch(self.data["state_dict"], module.state_dict())
        if problems:
            raise UserError(
                f"{self.key}={self.path} does not fit this model (check model=...): "
                + "; ".join(problems)
            )

    def tracker_versions(self, logger_cfg) -> dict[str, Any]:
        """Config key of a logger -> the version (run id) it logged to in the run that wrote
        this checkpoint. Checkpoints of earlier releases kept them by logger class name."""
        runs = self.data.get(TRACKERS, {})
        if not all(isinstance(v, dict) for v in runs.values()):
            return runs
        out = {}
        for key, node in (logger_cfg or {}).items():
            cls = str((node or {}).get("_target_", "")).rsplit(".", 1)[-1]
            if run := runs.get(cls):
                out[key] = next(iter(run.values()))
        return out

    def module(self, **overrides) -> ImageClassifier:
        """The LightningModule this checkpoint holds, in eval mode: rebuilt from its
        hyperparameters (`overrides` win), with its weights. Where the run averaged weights
        (EMA) those are the averaged ones, as test evaluated them."""
        takes = inspect.signature(ImageClassifier).parameters
        args = {k: v for k, v in self.hparams.items() if k in takes} | overrides
        try:
            module = ImageClassifier(**args)
            module.load_state_dict(self.data["state_dict"])
        except InvalidArgument as e:
            raise UserError(f"invalid config value for {e}") from e
        except Exception as e:
            raise UserError(f"{self.key}={self.path}: cannot load ({type(e).__name__}: {e})") from e
        return module.eval()


def resume_source(cfg) -> Path | None:
    """The checkpoint this run resumes from: `ckpt_path`, Lightning's `last`/`hpc` keywords,
    or (no ckpt_path, on SLURM) the requeue checkpoint Lightning would pick itself."""
    ckpt, root = cfg.get("ckpt_path"), Path(cfg.run_dir)
    if ckpt and ckpt not in KEYWORDS:
        return Path(ckpt)
    if ckpt == "last":
        return root / "checkpoints" / "last.ckpt"
    if ckpt == "hpc" or (ckpt is None and SLURMEnvironment.detect()):
        hpc = sorted(root.glob("hpc_ckpt_*.ckpt"), key=lambda p: int(re.sub(r"\D", "", p.stem)))
        if hpc:
            return hpc[-1]
        if ckpt == "hpc":
            raise UserError(f"ckpt_path=hpc: no hpc_ckpt_*.ckpt in {root}")
    return None


class Record(Callback):
    """Writes into every checkpoint the settings a resume must keep and the version (run id)
    of each logger, by its config key. The precision is the mode in use, which `auto` chooses
    only once fit has started."""

    def __init__(self, settings: dict, loggers: dict, precision=None) -> None:
        self.settings, self.loggers, self.precision = settings, loggers, precision

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        mode = {"precision": self.precision.name} if self.precision is not None else {}
        checkpoint[SETTINGS] = self.settings | mode
        versions = {k: lg.version for k, lg in self.loggers.items()}
        checkpoint[TRACKERS] = {k: v for k, v in versions.items() if v not in (None, "")}
