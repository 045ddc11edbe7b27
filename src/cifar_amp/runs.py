"""A run's dir is its own: claimed for the run's life, refused if used (unless resuming); what
the run writes there; and a resume into a new run dir keeps the best checkpoint."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from cifar_amp.errors import UserError

log = logging.getLogger(__name__)
LOCK = ".lock"


@contextlib.contextmanager
def claim(run_dir: str, resuming: bool):
    """Hold `run_dir` for the run's life (an OS lock on `<run_dir>/.lock`, released on exit,
    also by a kill); refuse a dir that another run holds, or one already used unless resuming;
    keep the CSV log of the run resumed (Lightning's CSVLogger deletes metrics.csv when it
    starts). The lock closes the gap in the re-use check: two runs started at once with the
    same `hydra.run.dir` would both find it unused. Only global rank 0 claims."""
    if rank_zero_only.rank != 0:
        yield
        return
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / LOCK, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(
            f"run dir {run_dir} is in use by another run (it holds {root / LOCK}); "
            "wait for that run to end or pick a new hydra.run.dir"
        ) from None
    try:
        if (root / "config.yaml").exists() and not resuming:
            raise UserError(
                f"run dir {run_dir} already holds a run; resume it with "
                f"ckpt_path={root / 'checkpoints' / 'last.ckpt'} or pick a new hydra.run.dir"
            )
        old, n = root / "metrics.csv", 1
        while old.is_file() and old.with_name(f"metrics.{n}.csv").exists():
            n += 1
        if old.is_file():
            old.rename(old.with_name(f"metrics.{n}.csv"))
        yield
    finally:
        lock.release()


@rank_zero_only
def save_config(cfg) -> None:
    """The resolved config, `<run_dir>/config.yaml`: what the run was (and a used dir's mark)."""
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, Path(cfg.run_dir) / "config.yaml", resolve=True)


@rank_zero_only
def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


class ResumableModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint that keeps its ranking when a run resumes into another
    `dirpath` (`ckpt_path=<old run>/checkpoints/last.ckpt` with a new run dir).

    Lightning restores the best score and the top-k only when `dirpath` is unchanged, so the
    first validation after such a resume always counted as the best and the final test ran on
    it. Here the ranked files are copied into the new dirpath and the ranking refers to the
    copies; the old run dir is never written to. If a ranked file is gone, the ranking starts
    afresh, as in Lightning, with a warning. Without a `monitor` (last.ckpt) nothing is ranked.
    """

    @functools.cached_property
    def state_key(self) -> str:
        # ModelCheckpoint's key: checkpoints written with the plain class resume with their
        # ranking. Cached: its arguments never change, and Lightning asks for it at each hook
        # call of each step (ModelCheckpoint formats a dict of five arguments every time).
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old_dir = state_dict.get("dirpath")
        if old_dir is None or self.dirpath is None or Path(old_dir) == Path(self.dirpath):
            return super().load_state_dict(state_dict)
        if self.monitor is None:
            return
        ranked = {Path(p): score for p, score in state_dict.get("best_k_models", {}).items()}
        if missing := [p for p in ranked if not p.is_file()]:
            log.warning(
                "Resumed into %s, but %s is gone: the best-checkpoint ranking starts afresh",
                self.dirpath,
                missing[0],
            )
            return
        moved = {p: Path(self.dirpath) / os.path.relpath(p, old_dir) for p in ranked}
        if rank_zero_only.rank == 0:
            for old, new in moved.items():
                tmp = new.with_name(f".{new.name}.copy")  # a kill mid-copy leaves no half file
                new.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(old, tmp)
                os.replace(tmp, new)
            log.info(
                "Resumed into %s: copied its ranked checkpoints from %s", self.dirpath, old_dir
            )

        def here(path: str) -> str:
            return str(moved[Path(path)]) if path and Path(path) in moved else path

        super().load_state_dict(
            state_dict
            | {
                "dirpath": self.dirpath,
                "best_k_models": {str(moved[p]): score for p, score in ranked.items()},
                "best_model_path": here(state_dict["best_model_path"]),
                "kth_best_model_path": here(state_dict.get("kth_best_model_path", "")),
                "last_model_path": "",  # written anew here
            }
        )
