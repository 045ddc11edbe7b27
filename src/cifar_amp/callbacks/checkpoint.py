"""ModelCheckpoint that keeps its ranking when a run resumes into another run dir."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only

from cifar_amp.reliability.atomic_io import copy_atomically

log = logging.getLogger(__name__)


class ResumableModelCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, plus: resumed into another `dirpath` (`ckpt_path=<old
    run>/checkpoints/last.ckpt` with a new run dir), it keeps the best score and the top-k.

    Lightning restores them only when `dirpath` is unchanged, so the first validation after such
    a resume always counted as the best and the final test ran on it. Here the ranked files are
    copied into the new dirpath and the ranking refers to the copies: the new run dir holds its
    best checkpoint (for `eval.py`), and the old run dir is never written to. If a ranked file is
    gone, the ranking starts afresh, as in Lightning, with a warning. Callbacks without a
    `monitor` rank nothing: their file (last.ckpt) is written anew in the new dirpath.
    """

    @property
    def state_key(self) -> str:
        # Lightning keys a callback's checkpoint state by its class name; keep ModelCheckpoint's,
        # so checkpoints written with the plain class (before this one) resume with their ranking.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old_dir = state_dict.get("dirpath")
        if old_dir is None or self.dirpath is None or Path(old_dir) == Path(self.dirpath):
            super().load_state_dict(state_dict)
            return
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
                copy_atomically(old, new)
            log.info(
                "Resumed into %s: copied its ranked checkpoints from %s", self.dirpath, old_dir
            )

        def here(path: str) -> str:
            return str(moved[Path(path)]) if path and Path(path) in moved else path

        super().load_state_dict(
            {
                **state_dict,
                "dirpath": self.dirpath,
                "best_k_models": {str(moved[p]): score for p, score in ranked.items()},
                "best_model_path": here(state_dict["best_model_path"]),
                "kth_best_model_path": here(state_dict.get("kth_best_model_path", "")),
                "last_model_path": "",  # written anew here
            }
        )
