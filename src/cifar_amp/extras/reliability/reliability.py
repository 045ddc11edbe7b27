"""Extra (docs/fork.md): runs that survive kills, full disks and NaNs (docs/reliability.md).
Nothing in the core imports it; configs/{callbacks,trainer,logger}/reliability/ attach it."""

from __future__ import annotations

import csv
import io
import logging
import re
import shlex
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning_utilities.core.apply_func import apply_to_collection

from cifar_amp.errors import UserError
from cifar_amp.extras.reliability import compat
from cifar_amp.runs import WriteFailed, write_atomically, write_text
from cifar_amp.seams import StopSignal

log = logging.getLogger(__name__)
# What runs.write_atomically leaves of a checkpoint if killed mid-write.
_TEMP_NAME = re.compile(r"\..+\.ckpt\.[A-Za-z0-9_]+\.tmp")


# -- checkpoint writes that a kill or a full disk cannot tear ---------------------------------
class AtomicCheckpointIO(TorchCheckpointIO):
    """Why not Lightning's TorchCheckpointIO: it stages the file in the system temp dir and moves
    it, a copy where /tmp is another filesystem (usual on clusters) that a kill leaves truncated,
    never fsync'ed; a full disk ended in two tracebacks. Here: runs.write_atomically, one line
    (runs.WriteFailed). Remote paths (s3://, ...) keep Lightning's behaviour."""

    _cleaned: set[Path] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None or not compat.is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        folder = Path(path).parent
        if folder not in self._cleaned:  # once, before the first write (the run dir is locked)
            self._cleaned.add(folder)
            for p in folder.glob(".*.tmp"):
                if _TEMP_NAME.fullmatch(p.name) and p.is_file():
                    p.unlink(missing_ok=True)
                    log.warning("Removed %s, left by a checkpoint write that was killed", p)
        write_atomically(Path(path), lambda f: torch.save(checkpoint, f))


class BackgroundCheckpointIO(CheckpointIO):
    """The atomic writer on a background thread, so that a checkpoint does not stall training:
    the training thread only copies the tensors (a device copy on a GPU) and the thread
    serialises, writes and fsyncs. Unlike Lightning's AsyncCheckpointIO, a removal waits behind
    the writes asked for before it (ModelCheckpoint removes the file a new best replaces right
    after asking for the new one: removed at once, a failed write of the new one left neither),
    and after a failed write nothing more is written or removed. The failure is raised on the
    training thread at the next save or removal, or at the end of fit."""

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        self.checkpoint_io = checkpoint_io or AtomicCheckpointIO()
        self.writer: ThreadPoolExecutor | None = None  # one thread, started at the first write
        self.error: BaseException | None = None  # a write's, for the training thread to raise
        self.failed = False  # stays set: the files are left as the failure found them

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        self.raise_failure()
        if self.failed:  # nothing more is written: no copy to make
            return
        # A copy taken now: the training thread goes on changing the weights in place.
        checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
        self.in_turn(self.checkpoint_io.save_checkpoint, checkpoint, path, storage_options)

    def load_checkpoint(self, *args, **kwargs) -> dict[str, Any]:
        return self.checkpoint_io.load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, path) -> None:
        self.raise_failure()
        self.in_turn(self.checkpoint_io.remove_checkpoint, path)

    def in_turn(self, do, *args) -> None:
        """Run `do(*args)` on the writer thread, after what was asked of it before."""

        def run() -> None:
            if self.error is None and not self.failed:
                try:
                    do(*args)
                except BaseException as e:
                    self.error = e

        if self.writer is None:
            self.writer = ThreadPoolExecutor(max_workers=1)
        self.writer.submit(run)

    def wait(self) -> None:
        """Return once every write asked for has landed; raise the failure of one."""
        if self.writer is not None:
            self.writer.submit(lambda: None).result()
        self.raise_failure()

    def teardown(self) -> None:
        if self.writer is not None:
            self.writer.shutdown(wait=True)
            self.writer = None
        self.raise_failure()

    def raise_failure(self) -> None:
        # Once: a trainer that fails tears down again, which must not raise it a second time.
        error = self.error
        if error is not None:
            self.failed = True
            self.error = None
            raise error


class AtomicCSVLogger(CSVLogger):
    """Lightning's CSVLogger (`logger=csv`), whose metrics.csv is replaced whole at each save
    (runs.write_atomically): Lightning's appends to it in place, and rewrites it in place when
    a column is new, which a full disk left torn or empty. A save (every
    flush_logs_every_n_steps steps) reads the rows back to write them with the new ones."""

    @rank_zero_only
    def save(self) -> None:
        writer = self.experiment
        if not writer.metrics:
            return
        path = Path(writer.metrics_file_path)
        keys = sorted(set(writer.metrics_keys).union(*writer.metrics))
        rows = []
        if path.is_file():
            with path.open(newline="") as f:
                rows = list(csv.DictReader(f))
        text = io.StringIO()
        table = csv.DictWriter(text, fieldnames=keys)
        table.writeheader()
        table.writerows([*rows, *writer.metrics])
        write_text(path, text.getvalue())
        writer.metrics_keys[:], writer.metrics = keys, []

    @rank_zero_only
    def finalize(self, status: str) -> None:
        try:
            super().finalize(status)
        except WriteFailed as e:
            if status != "failed":
                raise
            log.warning("%s", e)  # the run failed of something else: that is the error to name


# -- SIGTERM (preemption, scancel, kill) and Ctrl+C --------------------------------------------
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SaveOnSignal(Callback, StopSignal):
    """Save last.ckpt and stop cleanly on SIGTERM and on the first Ctrl+C; a second aborts.

    A signal stops the run at the next end of an accumulation window, where every gradient is
    in the weights (a window in progress is finished: at most accumulate_grad_batches - 1 more
    micro-batches), and never inside a validation (its running metrics are not checkpointed):
    there this sets Lightning's SIGTERM flag, Lightning raises SIGTERMException and on_exception
    saves, so a resume is exact. Under DDP the ranks share whether any has had a signal every
    `share_every` optimizer steps, after each validation and at each epoch end, and all stop at
    the same step; Lightning's own broadcast of its flag at every step is turned off."""

    def __init__(self, share_every: int = 10) -> None:
        if share_every < 1:
            raise UserError(f"callbacks.save_on_signal: share_every={share_every} must be >= 1")
        self.share_every = share_every
        self._trainer = None  # while fitting
        self._before: dict[int, Any] = {}  # the handlers before fit, where signals go after it
        self._ranks, self._rank = 1, 0
        self._fresh()

    def _fresh(self) -> None:
        self.signum: int | None = None  # the signal this process had
        self._stop = False  # decided (on every rank alike): stop at this window end
        self._stepped = False  # the batch in progress has stepped the optimizer
        self._open = False  # the last training batch left its accumulation window open
        self._steps = 0  # optimizer steps since the last decision

    def on_fit_start(self, trainer, pl_module) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._trainer, self._ranks, self._rank = trainer, trainer.world_size, trainer.global_rank
        self._fresh()
        self._before = {s: signal.signal(s, self._handle) for s in SIGNALS}
        if self._ranks > 1:
            compat.no_flag_broadcast_per_step(trainer)

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._own_signals()

    def on_train_start(self, trainer, pl_module) -> None:
        self._own_signals()

    def _own_signals(self) -> None:
        # Lightning registers its SIGTERM handler after on_fit_start, calling this one after its
        # own, which under DDP broadcasts from rank 0 wherever the signal lands (a collective
        # the other ranks do not make there): this one alone from now on.
        if self._trainer is not None:
            for s in SIGNALS:
                signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self._trainer is None:  # after fit (Lightning's teardown restores this handler)
            return self._pass_on(signum, frame)
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl+C: stop now, without saving
        if self.signum is None or signum == signal.SIGINT:
            again = " (press Ctrl+C again to abort)" if signum == signal.SIGINT else ""
            log.warning(
                "%s: finishing this optimizer step, then saving a checkpoint%s",
                signal.Signals(signum).name,
                again,
            )
        self.signum = signum
        if not self._stop:  # Lightning's own handler (before on_train_start) may have set it
            compat.set_received_sigterm(self._trainer, False)

    def _pass_on(self, signum, frame) -> None:
        before = self._before.get(signum)
        signal.signal(signum, before if before is not None else signal.SIG_DFL)
        if callable(before):
            before(signum, frame)
        elif before in (None, signal.SIG_DFL):
            signal.raise_signal(signum)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._stepped = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._open, self._stepped = not self._stepped, False
        if self._open or self._trainer is None:
            return
        self._steps += 1
        if self._steps >= self.share_every if self._ranks > 1 else self.signum is not None:
            self._decide(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._stop:  # decided at the batch before it: stop after it
            compat.set_received_sigterm(trainer, False)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._trainer is None or trainer.sanity_checking:
            return
        if not (self._open or self._stop):
            self._decide(trainer)
        if self._stop:
            compat.set_received_sigterm(trainer, True)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._trainer is None or self._open or self._stop:
            return
        if self._ranks == 1 or self._steps:  # (not again right after a validation's)
            self._decide(trainer)

    def _decide(self, trainer) -> None:
        """At a window end, on every rank at once: stop if any rank has had a signal."""
        self._steps = 0
        signalled = self.signum is not None
        if self._ranks > 1:  # public: a collective, and a host-device sync, every share_every
            signalled = trainer.strategy.reduce_boolean_decision(signalled, all=False)
        if signalled:
            self._stop = True
            compat.set_received_sigterm(trainer, not trainer.validating)

    @property
    def exit_code(self) -> int:
        # Ranks > 0 end cleanly: Lightning's launcher of `ddp` kills every rank (the command
        # too) when one exits non-zero, and rank 0 says why the run stopped.
        return 0 if self._rank else 128 + (self.signum or signal.SIGTERM)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and self._trainer is not None:
            signum = self.signum or signal.SIGTERM  # another rank's, under DDP
            path = last_checkpoint_path(trainer)
            trainer.save_checkpoint(path)
            if isinstance(io := trainer.strategy.checkpoint_io, BackgroundCheckpointIO):
                io.wait()  # "saved" below is then true, and a failed write says so instead
            if self._rank:  # every rank stops at the same step: its log says which
                log.info("rank %d: stopped at step %d", self._rank, trainer.global_step)
            else:
                msg = (
                    f"{signal.Signals(signum).name}: stopped at epoch {trainer.current_epoch}, "
                    f"step {trainer.global_step}; saved {path}. Resume with: "
                    f"{resume_command(path, trainer.default_root_dir)}"
                )
                log.warning(msg)
                print(msg, file=sys.stderr, flush=True)
        self._restore()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._trainer is not None:
            self._trainer = None
            for s, handler in self._before.items():
                signal.signal(s, handler)


def last_checkpoint_path(trainer) -> Path:
    """Where the checkpoint callbacks write last.ckpt, so that it is always the newest state."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


def resume_command(ckpt: Path, run_dir: str) -> str:
    """The command line that continues this run in the same run dir from `ckpt`, without
    overrides that start a run from other weights (`init_from`: a resume has its own)."""
    if not HydraConfig.initialized():
        return f"train(cfg) with ckpt_path={ckpt}"
    drop = ("ckpt_path=", "hydra.run.dir=", "init_from=")
    keep = [o for o in HydraConfig.get().overrides.task if not o.startswith(drop)]
    return "python " + shlex.join(
        [sys.argv[0] or "train.py", *keep, f"ckpt_path={ckpt}", f"hydra.run.dir={run_dir}"]
    )


# -- non-finite losses --------------------------------------------------------------------
class NonFiniteLossError(UserError):
    pass


class StopOnNonFiniteLoss(Callback):
    """Reports non-finite training losses with their step and stops after `patience` in a row
    (losses, not gradients: under 16-mixed the GradScaler skips inf-gradient steps on its own).
    Every `check_every` steps the losses are checked on the device and the result read at the
    next check, so a step never waits for the GPU; a checkpoint write waits, and refuses
    non-finite weights."""

    def __init__(self, patience: int = 10, check_every: int = 25) -> None:
        if patience < 1 or check_every < 1:
            raise UserError(
                f"callbacks.non_finite: patience={patience} and check_every={check_every} must be >= 1"
            )
        self.patience, self.check_every = patience, check_every
        self._run: torch.Tensor | None = None  # consecutive non-finite losses, as last checked
        self._losses: list[torch.Tensor] = []  # since the last check
        self._steps: list[int] = []  # their global steps
        self._copy: _HostCopy | None = None  # (run, first non-finite of a check) to the host

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        self._losses.append(loss.detach())
        self._steps.append(trainer.global_step)
        if trainer.global_step % self.check_every == 0:
            self._check(trainer, wait=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # Runs before the file is written: raising here keeps the previous file.
        self._check(trainer, wait=True)
        # Buffers too: BatchNorm running statistics turn NaN before any weight does.
        tensors = [
            *pl_module.parameters(),
            *(b for b in pl_module.buffers() if b.is_floating_point()),
        ]
        if not torch.stack([t.detach().isfinite().all() for t in tensors]).all():
            self._stop(trainer, f"the weights became non-finite by step {trainer.global_step}")

    def _check(self, trainer, wait: bool) -> None:
        """Read the result of the last check (unless still in flight), then check the losses
        kept since; `wait`: read this check's result now."""
        if self._copy is not None:
            if not (wait or self._copy.arrived()):
                return  # the GPU is that far behind: look again at the next check
            self._report(trainer, self._copy)
        if not self._losses:
            return
        bad = ~torch.isfinite(torch.stack(self._losses))
        n, steps = len(self._losses), self._steps
        self._losses, self._steps = [], []
        at = torch.arange(n, device=bad.device)
        first = torch.where(bad, at, n).min()  # n: none
        last_finite = torch.where(bad, -1, at).max()  # -1: none
        if self._run is None:
            self._run = torch.zeros((), dtype=torch.long, device=bad.device)
        self._run = torch.where(last_finite < 0, self._run + n, n - 1 - last_finite)
        self._copy = _HostCopy(torch.stack([self._run, first]), steps)
        if wait or self._copy.event is None:
            self._report(trainer, self._copy)

    def _report(self, trainer, copy: _HostCopy) -> None:
        self._copy = None
        run, first = copy.values()
        if first >= len(copy.steps):
            return
        log.warning(
            "non-finite training loss at step %d (%d consecutive so far)", copy.steps[first], run
        )
        if run >= self.patience:
            self._stop(
                trainer,
                f"the training loss was non-finite for {run} consecutive steps up to step "
                f"{copy.steps[-1]}",
            )

    def _stop(self, trainer, what: str) -> None:
        last = last_checkpoint_path(trainer)
        kept = (
            f"the last good checkpoint is {last}" if last.is_file() else "no checkpoint was written"
        )
        raise NonFiniteLossError(
            f"{what}; stopped (callbacks.non_finite.patience={self.patience}); {kept}. "
            "Try a lower module.optimizer.lr, trainer.gradient_clip_val, or precision=32-true / bf16-mixed"
        )


class _HostCopy:
    """A device tensor copied to the host without waiting (CUDA: pinned memory, an event)."""

    def __init__(self, tensor: torch.Tensor, steps: list[int]) -> None:
        self.steps = steps  # the global steps of the losses checked
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event() if tensor.is_cuda else None
        if self.event is not None:
            self.event.record()

    def arrived(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()  # at once when arrived(); a wait only before a checkpoint
        return self.host.tolist()
