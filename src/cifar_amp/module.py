"""The LightningModule: a network, a loss, torchmetrics, and the optimizer + schedule."""

from __future__ import annotations

import copy
import inspect
import math
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from hydra.utils import get_class, instantiate
from lightning import LightningModule
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from cifar_amp import metrics as M
from cifar_amp import tta as TTA
from cifar_amp.errors import InvalidArgument, NestedBuildError, UserError

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
NAMES = {
    "train": (M.TRAIN_LOSS, M.TRAIN_ACC),
    "val": (M.VAL_LOSS, M.VAL_ACC),
    "test": (M.TEST_LOSS, M.TEST_ACC),
}
SGD = MappingProxyType(
    {"_target_": "torch.optim.SGD", "lr": 0.2, "momentum": 0.9, "nesterov": True}
    | {"weight_decay": 5e-4, "fused": None}
)
ONE_CYCLE = MappingProxyType(
    {"_target_": "cifar_amp.schedules.OneCycleLR", "pct_start": 0.25, "anneal_strategy": "linear"}
)


class ImageClassifier(LightningModule):
    """Cross-entropy classification with the network that `net` (`_target_` + arguments) builds.

    A step only `update()`s the torchmetrics objects, on the device; they are computed and
    logged (one host read) at epoch end. Calling a metric or `self.log`-ging it in a step would
    compute a per-batch value and walk Lightning's result collection at every step: host work
    the GPU waits for.
    """

    def __init__(
        self,
        net: Mapping,
        num_classes: int,
        # What configure_optimizers instantiates with `params=`. `fused: true`: one kernel per
        # step, and under 16-mixed the GradScaler skips a step without reading its inf check on
        # the host; it cannot be combined with clipping under 16-bit mixed modes. null = torch's.
        optimizer: Mapping = SGD,
        # Instantiated with `optimizer=`, stepped every optimizer step; one that takes
        # `total_steps` is planned for the run's optimizer steps. null = a constant rate.
        scheduler: Optional[Mapping] = ONE_CYCLE,
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
        lr = optimizer.get("lr")
        for arg, value, ok, rule in (
            ("label_smoothing", label_smoothing, 0.0 <= label_smoothing < 1.0, "must be in [0, 1)"),
            ("tta", repr(tta), tta in TTA.MODES, f"valid: {', '.join(TTA.MODES)}"),
            ("tta_shift", tta_shift, 1 <= tta_shift <= 8, "must be in [1, 8]"),
            (
                "compile_mode",
                repr(compile_mode),
                compile_mode in COMPILE_MODES,
                f"valid: {', '.join(COMPILE_MODES)}",
            ),
            (
                "optimizer.lr",
                lr,
                not isinstance(lr, (int, float)) or (lr > 0 and math.isfinite(lr)),
                "must be > 0",
            ),
        ):
            if not ok:
                raise InvalidArgument(arg, value, rule)
        # Plain dicts, saved with the rest: a checkpoint rebuilds this module from itself.
        net, optimizer, scheduler = dict(net), dict(optimizer), scheduler and dict(scheduler)
        super().__init__()
        self.save_hyperparameters(logger=False)
        try:
            self.net: nn.Module = instantiate(net, num_classes=num_classes)
        except Exception as e:
            raise NestedBuildError("model", e) from e
        if channels_last:
            self.net.to(memory_format=torch.channels_last)
        # validate_args and the NaN check would read tensors on the host at every step.
        for stage in NAMES:
            setattr(
                self,
                f"{stage}_acc",
                MulticlassAccuracy(num_classes, average="micro", validate_args=False),
            )
            setattr(self, f"{stage}_loss", MeanMetric(nan_strategy="disable"))
        self.val_acc_best = MaxMetric()
        # Checkpointed: the best score, and the running training metrics for a mid-epoch resume.
        for metric in (self.val_acc_best, self.train_loss, self.train_acc):
            metric.persistent(True)

    def configure_model(self) -> None:
        # In place (nn.Module.compile), so state-dict keys are the same compiled or not.
        if self.hparams.compile:
            self.net.compile(mode=self.hparams.compile_mode)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        x, y = batch
        hp = self.hparams
        logits = (
            TTA.predict(self, x, hp.tta, hp.tta_shift)
            if stage == "test" or (stage == "val" and hp.tta_val)
            else self(x)
        )
        loss = F.cross_entropy(
            logits, y, label_smoothing=hp.label_smoothing if stage == "train" else 0.0
        )
        # One value per sample, so the epoch value is a per-sample mean whatever the batch
        # sizes and ranks (torchmetrics drops `weight=` under nan_strategy="disable").
        getattr(self, f"{stage}_loss").update(loss.detach().expand(len(y)))
        getattr(self, f"{stage}_acc").update(logits.detach(), y)
        return loss

    def _log_epoch(self, stage: str) -> None:
        # Lightning computes the logged metric objects (synced across ranks) and resets them.
        for name, metric in zip(NAMES[stage], ("loss", "acc"), strict=True):
            bar = metric == "acc" or stage != "train"
            self.log(
                name, getattr(self, f"{stage}_{metric}"), prog_bar=bar, on_step=False, on_epoch=True
            )

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # With the epoch's last batch, not in on_train_epoch_end: Lightning runs the module's
        # epoch-end hook after the callbacks', which may read the epoch's values there.
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
        if not self.trainer.sanity_checking:
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
        (a batch, or a tuple whose first item is one), with test's test-time augmentation."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return TTA.predict(self, x, self.hparams.tta, self.hparams.tta_shift).float().softmax(-1)

    def configure_optimizers(self):
        optimizer = instantiate(self.hparams.optimizer, params=self.parameters())
        if not (scheduler := self.hparams.scheduler):
            return optimizer
        planned = {}
        if "total_steps" in inspect.signature(get_class(scheduler["_target_"])).parameters:
            if not math.isfinite(total := self.trainer.estimated_stepping_batches):
                raise UserError(
                    "module.scheduler: a one-cycle schedule needs a run of known length; "
                    "set trainer.max_epochs or trainer.max_steps"
                )
            planned["total_steps"] = int(total)
        scheduler = instantiate(scheduler, optimizer=optimizer, **planned)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }
