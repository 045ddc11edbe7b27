"""Save a checkpoint and stop cleanly on SIGTERM (preemption, `scancel`, `kill`) and SIGINT (Ctrl+C).

Built on Lightning's signal connector: on SIGTERM it sets `trainer.received_sigterm`, finishes
the current training batch and raises SIGTERMException at the batch boundary (telling DDP
ranks and launched processes too). This callback routes the first Ctrl+C the same way
(Lightning alone would abort mid-step), saves last.ckpt when that exception arrives, and
prints where it is and the exact command that resumes it. A second Ctrl+C aborts at once.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from cifar_amp.reliability import private

log = logging.getLogger(__name__)


class SaveOnSignal(Callback):
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._deferred = False
        self._trainer = None

    def on_fit_start(self, trainer, pl_module) -> None:
        # Installed before Lightning registers its SIGTERM handler (right after on_fit_start),
        # which then calls this one after its own.
        if threading.current_thread() is not threading.main_thread():
            return
        self._trainer = trainer
        self._previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)
        }

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl+C: stop now, without saving
            self.signum = signal.SIGINT
            log.warning(
                "Ctrl+C: finishing this batch, then saving a checkpoint (press again to abort)"
            )
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's graceful path
            return
        self.signum = self.signum or signum
        trainer = self._trainer
        if trainer is not None and trainer.validating:
            # Lightning would stop mid-validation, and a resume cannot finish a half-run
            # validation exactly (its running metrics are not checkpointed). Stop right
            # after it instead: training checks the flag again at the next boundary.
            private.set_received_sigterm(trainer, False)
            self._deferred = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._deferred:
            private.set_received_sigterm(trainer, True)
            self._deferred = False

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()
        if not isinstance(exception, SIGTERMException):
            return
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            name = signal.Signals(self.signum or signal.SIGTERM).name
            msg = (
                f"{name}: stopped at epoch {trainer.current_epoch}, step {trainer.global_step}; "
                f"saved {path}. Resume with: {resume_command(path, trainer.default_root_dir)}"
            )
            log.warning(msg)
            print(msg, file=sys.stderr, flush=True)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    @property
    def exit_code(self) -> int:
        """The shell's convention for "killed by signal N": 128 + N."""
        return 128 + int(self.signum or signal.SIGTERM)


def last_checkpoint_path(trainer) -> Path:
    """Where the checkpoint callbacks write last.ckpt, so `ckpt_path=<run>/checkpoints/last.ckpt` is
    always the newest state."""
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.dirpath:
            return Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


def resume_command(ckpt: Path, run_dir: str) -> str:
    """The command line that continues this run in the same run dir, from `ckpt` (without
    `init_from`: the checkpoint holds the weights, and a resume refuses it)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return f"train(cfg) with ckpt_path={ckpt}"
    keep = [
        o
        for o in HydraConfig.get().overrides.task
        if not o.startswith(("ckpt_path=", "hydra.run.dir=", "init_from="))
    ]
    args = [*keep, f"ckpt_path={ckpt}", f"hydra.run.dir={run_dir}"]
    return "python " + shlex.join([sys.argv[0] or "train.py", *args])


def exit_code(trainer) -> int:
    """Exit status for a run that a signal stopped."""
    cbs = [cb for cb in trainer.callbacks if isinstance(cb, SaveOnSignal)]
    return cbs[0].exit_code if cbs else 128 + signal.SIGTERM
