"""A run's dir is its own, claimed, and refused if used unless resuming; what the run keeps there
is written here: config.yaml, metrics.json, the checkpoints' ranking across a resume."""

import contextlib
import functools
import io
import itertools
import json
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, Callable

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
    write_text(Path(cfg.run_dir) / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))


def write_metrics(cfg, result: dict) -> dict:
    """`<run_dir>/metrics.json` (on rank 0) and the log's `Results:` line; returns `result`."""
    if rank_zero_only.rank == 0:
        write_text(Path(cfg.run_dir) / "metrics.json", json.dumps(result, indent=2) + "\n")
    log.info("Results: %s", json.dumps(result))
    return result


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda f: f.write(text.encode()))


class WriteFailed(UserError):
    """A file could not be written (disk full, quota, I/O error): the file, why, the free space
    where it was going and the size it needed, in one line."""

    def __init__(self, path: Path, error: OSError, needed: int | None) -> None:
        try:
            free = _size(shutil.disk_usage(next(p for p in path.parents if p.is_dir())).free)
        except OSError:
            free = "?"
        sizes = f"{free} free there" + (f", {_size(needed)} needed" if needed else "")
        super().__init__(f"cannot write {path}: {error.strerror or error} ({sizes})")


def write_atomically(target: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `target` with `write(file)` through a temp file beside it, fsync'ed and renamed over
    it: a kill or a failure leaves the previous `target` (or none) and no partial file. An
    OSError, also one that the writer met and turned into another error (torch.save's zip
    writer does), is a WriteFailed."""
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    # 0o666 filtered by the umask is what a plain open() would give a new file.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(os.open(tmp, flags, 0o666), "wb") as f:
            if target.exists():  # an overwrite keeps the file's mode, as open(target, "wb") would
                os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        cause = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise WriteFailed(target, cause, _bytes_of(write)) from e
    with contextlib.suppress(OSError):  # make the rename durable (Windows cannot open dirs)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Count(io.RawIOBase):
    n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.n += len(b)
        return len(b)


def _bytes_of(write: Callable[[BinaryIO], None]) -> int | None:
    """The size of what `write` writes, counted without storing it."""
    count = _Count()
    try:
        write(count)
    except Exception:
        return None
    return count.n


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} bytes"
    unit = next(u for u in range(1, 5) if n < 1000 ** (u + 1) or u == 4)
    return f"{n / 1000**unit:.3g} {' kMGT'[unit]}B"


def window_open(trainer) -> bool:
    """Whether the epoch's training batches so far end inside an accumulation window: Lightning
    steps at every accumulate_grad_batches-th batch of an epoch, and at its last."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
    return done % trainer.accumulate_grad_batches != 0 and done != trainer.num_training_batches


def validation_follows(trainer, batch_idx: int) -> bool:
    """Whether Lightning validates after this training batch, as its training loop decides
    by batches (not by time, nor for an early stop)."""
    every_n_epochs = trainer.check_val_every_n_epoch
    if not trainer.enable_validation:
        return False
    if every_n_epochs is not None and (trainer.current_epoch + 1) % every_n_epochs:
        return False
    loop = trainer.fit_loop.epoch_loop
    if trainer.val_check_batch == float("inf"):
        return loop.batch_progress.is_last_batch
    batch = loop.total_batch_idx if every_n_epochs is None else batch_idx
    return (batch + 1) % trainer.val_check_batch == 0


class ResumableModelCheckpoint(ModelCheckpoint):
    """ModelCheckpoint whose ranking survives a resume into a new `dirpath`, by copying files in."""

    @functools.cached_property
    def state_key(self) -> str:
        # ModelCheckpoint's, to resume the plain class's ranking; cached: asked at every hook call
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    resumed_in_place = False  # resumed in the run dir its checkpoint was written in
    started_at = 0  # the global step this fit started (or resumed) at

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.started_at = trainer.global_step

    deferred: int | None = None  # the batch whose step's save waits for the validation after it

    def on_validation_end(self, trainer, pl_module) -> None:
        deferred, self.deferred = self.deferred, None
        # A validation inside an accumulation window (trainer.val_check_interval between two
        # steps): a checkpoint written now lacks the window's gradients, and a resume from it
        # stepped without them. last.ckpt stays at the window's start, from where a resume
        # runs the window and this validation again; a ranked (best) file is written, as its
        # weights are whole steps'.
        if self.monitor is None and window_open(trainer):
            return
        super().on_validation_end(trainer, pl_module)
        if deferred is not None:
            super().on_train_batch_end(trainer, pl_module, None, None, deferred)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The step a run resumes at was saved before the kill, but Lightning does not checkpoint
        # which step it last saved and saved it again at the first batch: a write that the
        # uninterrupted run does not make, and a flush of the running training metrics, whose
        # float sums then differed from that run's in the last bit (bench.kill_campaign).
        if trainer.global_step == self.started_at:
            return
        # Lightning resumes a checkpoint of a batch that a validation follows as one written
        # after that validation, and skips it: a kill during it lost it (val/acc_best and the
        # ranking differed). The step's save waits for the validation's end.
        if validation_follows(trainer, batch_idx):
            self.deferred = batch_idx
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def load_state_dict(self, state_dict: dict) -> None:
        old_dir = state_dict.get("dirpath")
        if old_dir is None or self.dirpath is None or Path(old_dir) == Path(self.dirpath):
            self.resumed_in_place = old_dir is not None
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

    def file_exists(self, filepath, trainer) -> bool:
        """Whether `filepath` is taken (ModelCheckpoint adds -v1 to a name that is). Resumed in
        place, a file that the restored ranking does not hold was written by this run after
        the checkpoint it resumed from, before it was killed: the uninterrupted run would write
        that name, so it is overwritten rather than kept beside a best-epoch001-v1.ckpt."""
        held = {*self.best_k_models, self.last_model_path}
        known = not self.resumed_in_place or str(filepath) in held
        return super().file_exists(filepath, trainer) and known
