"""The LightningModule: a network, a loss, torchmetrics, and the optimizer + schedule."""

import copy
import inspect
import math
from typing import Mapping, Optional

import torch
from hydra.utils import get_class, instantiate
from torch import Tensor, nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from cifar_amp import compiling, config, metrics, seams
from cifar_amp.errors import InvalidArgument, NestedBuildError, UserError
from cifar_amp.overhead import HookNameFastPath
from cifar_amp.tta import TTA_MODES, tta_logits


class ImageClassifier(HookNameFastPath):
    """Cross-entropy classification by `net`; steps update metrics on device, epochs log them."""

    def __init__(
        self,
        net: Mapping,
        num_classes: int,
        # A class and its settings each (configs/module/optimizer/ and scheduler/), which this
        # module builds with the parameters, the optimizer and the run's total_steps.
        optimizer: Optional[Mapping] = None,
        scheduler: Optional[Mapping] = None,  # stepped every optimizer step; None: constant
        label_smoothing: float = 0.0,  # training loss only
        channels_last: bool = False,  # NHWC weights; decided by the precision (precision.py)
        compile: bool = False,  # torch.compile the network
        compile_mode: str = "default",  # of compiling.MODES; reduce-overhead: CUDA graphs
        tta: str = "none",  # in test (and validation if `tta_val`): none | flip | flip_shift
        tta_shift: int = 1,  # pixels, for flip_shift (tta.py)
        tta_val: bool = False,
    ) -> None:
        choices = {"tta": (tta, TTA_MODES), "compile_mode": (compile_mode, compiling.MODES)}
        for arg, (value, valid) in choices.items():
            if value not in valid:
                raise InvalidArgument(arg, repr(value), f"valid: {', '.join(valid)}")
        if not 0 <= label_smoothing < 1:
            raise InvalidArgument("label_smoothing", label_smoothing, "must be in [0, 1)")
        if not 1 <= tta_shift <= 8:
            raise InvalidArgument("tta_shift", tta_shift, "must be in [1, 8]")
        for arg, node in (("optimizer", optimizer), ("scheduler", scheduler)):
            if node is not None and not (isinstance(node, Mapping) and "_target_" in node):
                raise InvalidArgument(arg, repr(node), f"choose one with module/{arg}=<option>")
            takes = config.arguments(get_class(node["_target_"])) if node else {}
            if bad := [k for k in node or () if k not in {"_target_", *takes}]:
                target, value = node["_target_"], node[bad[0]]
                raise InvalidArgument(f"{arg}.{bad[0]}", value, f"{target} takes no {bad[0]}")
        if optimizer and (lr := optimizer.get("lr")) is not None and not 0 < lr < math.inf:
            raise InvalidArgument("optimizer.lr", lr, "must be > 0")
        # Plain dicts, saved with the rest: a checkpoint rebuilds this module from itself.
        net, optimizer, scheduler = (n and dict(n) for n in (net, optimizer, scheduler))
        super().__init__()
        self.save_hyperparameters(logger=False)
        try:
            self.net: nn.Module = instantiate(net, num_classes=num_classes)
        except Exception as e:
            raise NestedBuildError("model", e) from e
        if channels_last:
            self.net.to(memory_format=torch.channels_last)
        for stage in ("train", "val", "test"):  # their input checks would read the device each step
            acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
            setattr(self, f"{stage}_acc", acc)
            setattr(self, f"{stage}_loss", MeanMetric(nan_strategy="disable"))
        self.val_acc_best = MaxMetric()
        # Checkpointed: the best score, and the running training metrics for a mid-epoch resume.
        for metric in (self.val_acc_best, self.train_loss, self.train_acc):
            metric.persistent(True)
        # Each step's (loss, predictions, targets), on the device, until the metrics take them.
        self._pending: dict[str, list] = {"train": [], "val": [], "test": []}

    def configure_model(self) -> None:
        if self.hparams.compile:
            compiling.compile_net(
                self.net, self.hparams.compile_mode, self.trainer.strategy.root_device
            )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        (x, y), hp = batch, self.hparams
        tta = hp.tta if stage == "test" or (stage == "val" and hp.tta_val) else "none"
        logits = tta_logits(self, x, tta, hp.tta_shift)
        smoothing = hp.label_smoothing if stage == "train" else 0.0
        loss = nn.functional.cross_entropy(logits, y, label_smoothing=smoothing)
        # The metrics take these once an epoch or checkpoint: an update per step made about 200
        # Python calls, which a GPU's step waits for (bench/call_count.py).
        self._pending[stage].append((loss.detach(), logits.detach().argmax(-1), y))
        return loss

    def _update_metrics(self, stage: str) -> None:
        if not (pending := self._pending[stage]):
            return
        losses, preds, targets = zip(*pending, strict=True)
        pending.clear()
        # One value per sample: a per-sample epoch mean whatever the batch sizes and ranks
        losses = [loss.expand(len(y)) for loss, y in zip(losses, targets, strict=True)]
        getattr(self, f"{stage}_loss").update(torch.cat(losses))
        getattr(self, f"{stage}_acc").update(torch.cat(preds), torch.cat(targets))

    def state_dict(self, *args, **kwargs):
        self._update_metrics("train")  # a checkpoint holds the running training metrics
        return super().state_dict(*args, **kwargs)

    def _log_epoch(self, stage: str) -> None:
        self._update_metrics(stage)
        for kind in ("loss", "acc"):  # Lightning computes them (synced across ranks), resets them
            key, bar = f"{stage}_{kind}", kind == "acc" or stage != "train"
            name = getattr(metrics, key.upper())  # metrics.TRAIN_LOSS for self.train_loss, ...
            self.log(name, getattr(self, key), prog_bar=bar, on_step=False, on_epoch=True)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # Not in on_train_epoch_end: Lightning runs it after the callbacks', which read these.
        if batch_idx + 1 >= self.trainer.num_training_batches:
            self._log_epoch("train")

    # Reset in each epoch's grad mode: states made under inference_mode fail under gloo's no_grad.
    def on_validation_epoch_start(self) -> None:
        for metric in (self.val_loss, self.val_acc, self.test_loss, self.test_acc):
            metric.reset()
        self._pending["val"].clear()
        self._pending["test"].clear()

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")  # first: it hands val_acc the epoch's steps
        if not self.trainer.sanity_checking:
            self.val_acc_best(self.val_acc.compute())
            self.log(metrics.VAL_ACC_BEST, self.val_acc_best.compute(), sync_dist=False)

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # A resume from an epoch's end starts the next one, so training metrics are saved reset.
        if self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            copies = (c for c in self.trainer.callbacks if isinstance(c, seams.ModelStateCopy))
            keys = {"state_dict", *(c.model_state_key for c in copies)}
            for name in ("train_loss", "train_acc"):
                fresh = copy.deepcopy(getattr(self, name))
                fresh.reset()
                for key in checkpoint.keys() & keys:
                    checkpoint[key].update(fresh.state_dict(prefix=f"{name}."))

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # A resume keeps the optimizer kernel it was trained with: the state it loads sets
        # `fused`, but not torch's flag that tells the GradScaler to hand the step its inf flag.
        saved = [s["param_groups"][0] for s in checkpoint.get("optimizer_states", [])][:1]
        if saved and "fused" in saved[0] and "fused" in (self.hparams.optimizer or {}):
            self.hparams.optimizer["fused"] = saved[0]["fused"]

    def predict_step(self, batch, batch_idx: int) -> Tensor:
        # Class probabilities, float32, with test's TTA; a batch, or a tuple whose first item is one
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return tta_logits(self, x, self.hparams.tta, self.hparams.tta_shift).float().softmax(-1)

    def configure_optimizers(self):
        if not self.hparams.optimizer:  # e.g. rebuilt from a checkpoint older than the setting
            raise UserError("module.optimizer is not set: e.g. module/optimizer=sgd")
        optimizer = instantiate(self.hparams.optimizer, params=self.parameters())
        if not (scheduler := self.hparams.scheduler):
            return optimizer
        if "total_steps" in inspect.signature(get_class(scheduler["_target_"])).parameters:
            if not math.isfinite(total := self.trainer.estimated_stepping_batches):
                raise UserError("module.scheduler needs trainer.max_epochs or max_steps")
            scheduler = {**scheduler, "total_steps": int(total)}
        scheduler = instantiate(scheduler, optimizer=optimizer)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]
