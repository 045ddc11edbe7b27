"""Lightning's work around each hook call, made cheaper: at every training step it calls every
per-step hook of every callback and of the module, each inside a profiler context, whether the
hook does anything or not. At the default recipe's 14 callbacks that was about half of a step's
Python calls (bench/call_count.py), which a GPU's 16-bit step waits for. And the learning-rate
monitor, whose copy of each logged rate onto the device made the host wait for the GPU."""

import contextlib
import logging

import lightning.pytorch.callbacks
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.profilers import PassThroughProfiler

from cifar_amp import compat

log = logging.getLogger(__name__)


class SkipUnusedHooks(Callback):
    """Hides the per-step hooks that each callback, and the module in training, leaves as its
    base class's no-op, by setting them to None on the object: Lightning skips a hook that is
    not callable (tests/test_overhead.py checks it still does). A hook the object provides in
    any way (its class or a mixin, an attribute set on it, a __getattribute__) stays."""

    STEP = [f"on_{h}" for h in ("train_batch_start", "train_batch_end", "before_backward")]
    STEP += [f"on_{h}" for h in ("after_backward", "before_optimizer_step", "before_zero_grad")]
    EVAL = [f"on_{s}_batch_{w}" for s in ("validation", "test") for w in ("start", "end")]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for callback in trainer.callbacks:
            self._hide(callback, Callback, self.STEP + self.EVAL)
        # The module's evaluation hooks stay: Lightning reads their signatures.
        self._hide(pl_module, LightningModule, self.STEP)

    @staticmethod
    def _hide(obj, base: type, hooks: list[str]) -> None:
        for hook in hooks:
            found = getattr(obj, hook, None)  # as Lightning will look it up
            if getattr(found, "__func__", None) is getattr(base, hook):
                setattr(obj, hook, None)


class QuietProfiler(PassThroughProfiler):
    """Lightning's default no-op profiler, handing out one shared context: the default makes a
    generator context per use, ten Python calls, and a step uses it about 40 times."""

    _nothing = contextlib.nullcontext()

    def profile(self, action_name: str) -> contextlib.nullcontext:
        return self._nothing


class LearningRateMonitor(compat.RatesOnHost, lightning.pytorch.callbacks.LearningRateMonitor):
    """Lightning's, with the rates it adds to `callback_metrics` (for EarlyStopping) kept on the
    host: Lightning copies each onto the training device at every logging step, a copy from
    pageable memory that waits for the GPU (compat.RatesOnHost). It says when the run is too
    short for any step to be logged (in place of Lightning's hint, messages.py)."""

    def on_train_start(self, trainer: Trainer, *args, **kwargs) -> None:
        super().on_train_start(trainer, *args, **kwargs)
        steps, every = trainer.estimated_stepping_batches, trainer.log_every_n_steps
        if self.logging_interval != "epoch" and steps < every and trainer.is_global_zero:
            log.warning(
                f"Logging: the run's {steps} optimizer steps are fewer than "
                f"trainer.log_every_n_steps={every}, so no step's values (the learning rate, "
                f"...) are logged, only epochs': trainer.log_every_n_steps={max(1, int(steps))} "
                "logs the last"
            )
