"""The LightningModule: a network, a loss, torchmetrics, and the optimizer + schedule."""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from lightning import LightningModule
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from cifar_amp import metrics as M
from cifar_amp import schedules
from cifar_amp import tta as TTA
from cifar_amp.errors import InvalidArgument, NestedBuildError

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
NAMES = {
    "train": (M.TRAIN_LOSS, M.TRAIN_ACC),
    "val": (M.VAL_LOSS, M.VAL_ACC),
    "test": (M.TEST_LOSS, M.TEST_ACC),
}


class ImageClassifier(LightningModule):
    """Cross-entropy classification with the network that `net` (`_target_` + arguments) builds.

    Metrics are torchmetrics objects that a step only `update()`s on the device; they are
    logged (computed, one host read) in the epoch-end hooks. Calling a metric (`forward`) or
    `self.log`-ging it in a step would also compute a per-batch value and walk Lightning's
    result collection at every step: host work the GPU waits for (docs/benchmarks-gpu.md).
    """

    def __init__(
        self,
        net: dict,
        num_classes: int,
        # Partials: the module adds `params` (and, for OneCycleLR, `optimizer`, `total_steps`
        # and `max_lr` = the optimizer's lr). Set `scheduler` to null for a constant rate.
        # `optimizer.fused=true`: one kernel per step, and under 16-mixed the GradScaler skips
        # a step without reading its inf check on the host; it cannot be combined with
        # clipping under 16-mixed/bf16-mixed (reliability/preflight.py). null = torch's choice.
        optimizer: Callable[..., torch.optim.Optimizer] = functools.partial(
            torch.optim.SGD, lr=0.2, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=None
        ),
        scheduler: Optional[Callable[..., Any]] = functools.partial(
            torch.optim.lr_scheduler.OneCycleLR, pct_start=0.25, anneal_strategy="linear"
        ),
        label_smoothing: float = 0.0,  # training loss only
        channels_last: bool = False,  # NHWC weights; decided by the precision (precision.py)
        compile: bool = False,  # torch.compile the network
        # torch.compile's mode when `compile`: default | reduce-overhead (CUDA graphs: the
        # least host work per step) | max-autotune | max-autotune-no-cudagraphs
        compile_mode: str = "default",
        # Test-time augmentation in test (and in validation if `tta_val`): none | flip |
        # flip_shift (flips plus +-`tta_shift`-pixel shifts); views and weights in tta.py.
        tta: str = "none",
        tta_shift: int = 1,
        tta_val: bool = False,
        # What the network expects (the DataModule's `meta`: class names, mean/std, image
        # size); passed by build.py and kept in every checkpoint for predict and export.
        data_meta: Optional[dict] = None,
    ) -> None:
        if not 0.0 <= label_smoothing < 1.0:
            raise InvalidArgument("label_smoothing", label_smoothing, "must be in [0, 1)")
        if tta not in TTA.MODES:
            raise InvalidArgument("tta", repr(tta), f"valid: {', '.join(TTA.MODES)}")
        if compile_mode not in COMPILE_MODES:
            raise InvalidArgument(
                "compile_mode", repr(compile_mode), f"valid: {', '.join(COMPILE_MODES)}"
            )
        if not 1 <= tta_shift <= 8:
            raise InvalidArgument("tta_shift", tta_shift, "must be in [1, 8]")
        # From the config, `_target_` nodes (built here, so `net` stays a config; see build.py).
        optimizer, scheduler = (
            instantiate(f) if isinstance(f, dict) else f for f in (optimizer, scheduler)
        )
        lr = getattr(optimizer, "keywords", {}).get("lr")
        if isinstance(lr, (int, float)) and not (lr > 0 and math.isfinite(lr)):
            raise InvalidArgument("optimizer.lr", lr, "must be > 0")
        super().__init__()
        # The network's config (not the optimizer partials) goes into every checkpoint, so
        # load_from_checkpoint / eval.py rebuild the right network from the file alone.
        self.save_hyperparameters(ignore=["optimizer", "scheduler"], logger=False)
        try:
            self.net: nn.Module = instantiate(net, num_classes=num_classes)
        except Exception as e:
            raise NestedBuildError("model", e) from e
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.label_smoothing = label_smoothing
        self.compile, self.compile_mode = compile, compile_mode
        self.tta, self.tta_shift, self.tta_val = tta, tta_shift, tta_val
        if channels_last:
            self.net.to(memory_format=torch.channels_last)
        # validate_args and the NaN check would read tensors on the host at every step
        # (a device sync per step); labels come from our loader and the loss is finite.
        for stage in NAMES:
            setattr(
                self,
                f"{stage}_acc",
                MulticlassAccuracy(num_classes, average="micro", validate_args=False),
            )
            setattr(self, f"{stage}_loss", MeanMetric(nan_strategy="disable"))
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)  # survives a resume
        # So are the training epoch's running loss/accuracy, for a resume mid-epoch.
        self.train_loss.persistent(True)
        self.train_acc.persistent(True)

    def configure_model(self) -> None:
        # In place (nn.Module.compile), so state-dict keys are the same compiled or not.
        if self.compile:
            self.net.compile(mode=self.compile_mode)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x, y = batch
        if stage == "test" or (stage == "val" and self.tta_val):
            logits = TTA.predict(self, x, self.tta, self.tta_shift)
        else:
            logits = self(x)
        smoothing = self.label_smoothing if stage == "train" else 0.0
        loss = F.cross_entropy(logits, y, label_smoothing=smoothing)
        # One value per sample, so the epoch value is a per-sample mean whatever the batch
        # sizes (and ranks); `weight=` would be dropped by torchmetrics under nan_strategy="disable".
        getattr(self, f"{stage}_loss").update(loss.detach().expand(len(y)))
        getattr(self, f"{stage}_acc").update(logits.detach(), y)
        return loss

    def _log_epoch(self, stage: str) -> None:
        # Lightning computes the logged metric objects (synced across ranks) and resets them.
        loss_name, acc_name = NAMES[stage]
        for name, metric, bar in (
            (loss_name, getattr(self, f"{stage}_loss"), stage != "train"),
            (acc_name, getattr(self, f"{stage}_acc"), True),
        ):
            self.log(name, metric, on_step=False, on_epoch=True, prog_bar=bar)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # With the epoch's last batch, not in on_train_epoch_end: Lightning runs the module's
        # epoch-end hook after the callbacks' (TrainingCurves reads the epoch's values there).
        if batch_idx + 1 >= self.trainer.num_training_batches:
            self._log_epoch("train")

    # Evaluation metrics start each epoch from zero, made in the epoch's own grad mode: states
    # made under inference_mode (one process) cannot be updated in place under the no_grad
    # that Lightning uses with gloo (CPU DDP), e.g. a test on one rank and then on two.
    def on_validation_epoch_start(self) -> None:
        self.val_loss.reset()
        self.val_acc.reset()

    def on_test_epoch_start(self) -> None:
        self.test_loss.reset()
        self.test_acc.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")
        if self.trainer.sanity_checking:
            return
        self.val_acc_best(self.val_acc.compute())
        self.log(M.VAL_ACC_BEST, self.val_acc_best.compute(), sync_dist=False)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # After an epoch's last batch the training metrics hold the epoch's totals (logged
        # already); a resume from here starts the next epoch, which must start from zero.
        if not self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return
        for name in ("train_loss", "train_acc"):
            fresh = copy.deepcopy(getattr(self, name))
            fresh.reset()
            for key in ("state_dict", "current_model_state"):  # the latter: EMA's raw weights
                if key in checkpoint:
                    checkpoint[key].update(fresh.state_dict(prefix=f"{name}."))

    def predict_step(self, batch, batch_idx: int) -> Tensor:
        """Class probabilities (N, num_classes), float32, of images normalised as in training
        (a batch, or a tuple whose first item is one), with the test-time augmentation of test."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return TTA.predict(self, x, self.tta, self.tta_shift).float().softmax(-1)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = schedules.build(self.scheduler_factory, optimizer, self.trainer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
