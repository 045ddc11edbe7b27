"""A run's dir is its own (claimed, refused if used unless resuming); what a run writes there."""

import contextlib
import functools
import itertools
import json
import logging
import os
import shutil
from pathlib import Path

from filelock import FileLock, Timeout
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from cifar_amp.errors import UserError

log = logging.getLogger(__name__)


@contextlib.contextmanager
def claim(run_dir: str, resuming: bool):
    """Hold `run_dir` (an OS lock), refuse a used one unless resuming, keep CSVLogger's old log."""
    if rank_zero_only.rank != 0:
        yield
        return
    (root := Path(run_dir)).mkdir(parents=True, exist_ok=True)
    lock = FileLock(root / ".lock", timeout=0)
    try:
        held = lock.acquire()
    except Timeout:
        raise UserError(
            f"run dir {run_dir} is in use by another run (it holds {lock.lock_file}); "
            "wait for that run to end or pick a new hydra.run.dir"
        ) from None
    with held:
        if (root / "config.yaml").exists() and not resuming:
            raise UserError(
                f"run dir {run_dir} already holds a run; resume it with "
                f"ckpt_path={root / 'checkpoints' / 'last.ckpt'} or pick a new hydra.run.dir"
            )
        if (csv := root / "metrics.csv").is_file():
            n = next(n for n in itertools.count(1) if not (root / f"metrics.{n}.csv").exists())
            csv.rename(root / f"metrics.{n}.csv")
        yield


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
    """ModelCheckpoint whose ranking survives a resume into a new `dirpath`, by copying files in."""

    @functools.cached_property
    def state_key(self) -> str:
        # ModelCheckpoint's, to resume the plain class's ranking; cached: asked at every hook call
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def load_state_dict(self, state_dict: dict) -> None:
        old_dir = state_dict.get("dirpath")
        if old_dir is None or self.dirpath is None or Path(old_dir) == Path(self.dirpath):
            return super().load_state_dict(state_dict)
        if self.monitor is None:  # last.ckpt only: nothing ranked
            return
        ranked = state_dict.get("best_k_models", {})
        if missing := [p for p in ranked if not Path(p).is_file()]:
            log.warning("Resumed into %s, but %s is gone: ranking afresh", self.dirpath, missing[0])
            return
        moved = {p: str(Path(self.dirpath) / os.path.relpath(p, old_dir)) for p in ranked}
        if rank_zero_only.rank == 0:
            for old, new in moved.items():
                Path(new).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(old, f"{new}.part")  # then renamed: a kill leaves no half file
                os.replace(f"{new}.part", new)
            log.info("Resumed into %s: copied the ranked checkpoints of %s", self.dirpath, old_dir)
        best, kth = state_dict["best_model_path"], state_dict.get("kth_best_model_path", "")
        super().load_state_dict(
            state_dict
            | {"dirpath": self.dirpath, "last_model_path": ""}  # last.ckpt: written anew here
            | {"best_model_path": moved.get(best, best), "kth_best_model_path": moved.get(kth, kth)}
            | {"best_k_models": {moved[p]: score for p, score in ranked.items()}}
        )
