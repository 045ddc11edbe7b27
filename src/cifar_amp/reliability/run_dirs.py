"""One run per run dir at a time, and a clean start in it."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from filelock import FileLock, Timeout
from lightning.pytorch.utilities import rank_zero_only

from cifar_amp.errors import UserError
from cifar_amp.reliability import atomic_io, preflight

log = logging.getLogger(__name__)

LOCK = ".lock"


@contextlib.contextmanager
def claim(run_dir: str, ckpt_path: str | None):
    """Hold `run_dir` for the life of the run (an OS lock on `<run_dir>/.lock`, released on exit,
    also by a kill), refuse a dir that another run holds or already used (unless resuming), and
    remove temp files that a killed checkpoint write left there.

    The lock closes the gap in the re-use check: two runs started at once with the same
    `hydra.run.dir` would both find the dir unused. Only global rank 0 takes it: the other
    ranks of a DDP run work in the same dir.
    """
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
        preflight.check_run_dir(run_dir, ckpt_path)
        for path in atomic_io.remove_stale_temps(root):
            log.warning("Removed %s, left by a checkpoint write that was killed", path)
        yield
    finally:
        lock.release()
