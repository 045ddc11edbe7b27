"""The LightningModule: a network, its loss and metrics, the optimizer and its schedule. The work
that keeps a step fast (metrics updated once an epoch, their logging, exact resumes) is
LeanModule's (lean_module.py): the steps below only hand it their loss, logits and targets."""

import math
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import Tensor, nn

from cifar_amp import compiling, config, metrics
from cifar_amp.errors import InvalidArgument, NestedBuildError, UserError
from cifar_amp.lean_module import LeanModule
from cifar_amp.tta import TTA_MODES, TestTimeAugmented, tta_logits

# The default metrics: name -> a torchmetrics class and its arguments (num_classes filled in).
# Micro-averaged: the fraction of images classified right (torchmetrics' default is per class).
ACCURACY = {
    metrics.ACC: {"_target_": "torchmetrics.classification.MulticlassAccuracy", "average": "micro"}
}


class ImageClassifier(LeanModule, TestTimeAugmented):
    """Cross-entropy classification of images by `net`."""

    def __init__(
        self,
        net: Mapping,  # the network's config (configs/model/), built here with num_classes
        num_classes: int,
        # A class and its settings each (configs/module/optimizer/ and scheduler/), built by
        # configure_optimizers with the parameters, the optimizer and the run's total_steps.
        optimizer: Optional[Mapping] = None,
        scheduler: Optional[Mapping] = None,  # stepped every optimizer step; None: constant
        # Computed in every stage, logged as <stage>/<name> (docs/fork.md, "A metric by config").
        metrics: Mapping[str, Mapping] = ACCURACY,
        label_smoothing: float = 0.0,  # training loss only
        channels_last: bool = False,  # NHWC weights; decided by the precision (precision.py)
        compile: bool = False,  # torch.compile the network
        compile_mode: str = "default",  # of compiling.MODES; reduce-overhead: CUDA graphs
        tta: str = "none",  # in test (and validation if `tta_val`): none | flip | flip_shift
        tta_shift: int = 1,  # pixels, for flip_shift (tta.py)
        tta_val: bool = False,
        # The run's `monitor` (config.Monitor, the config's top level), passed by build.module.
        monitor: str = metrics.ACC,
        monitor_mode: str = "max",
    ) -> None:
        if tta not in TTA_MODES:
            raise InvalidArgument("tta", repr(tta), f"valid: {', '.join(TTA_MODES)}")
        if compile_mode not in compiling.MODES:
            raise InvalidArgument(
                "compile_mode", repr(compile_mode), f"valid: {', '.join(compiling.MODES)}"
            )
        if not 0 <= label_smoothing < 1:
            raise InvalidArgument("label_smoothing", label_smoothing, "must be in [0, 1)")
        if not 1 <= tta_shift <= 8:
            raise InvalidArgument("tta_shift", tta_shift, "must be in [1, 8]")
        # Checked, and kept as plain data: a checkpoint rebuilds this module from itself.
        optimizer = config.checked_node("optimizer", optimizer)
        scheduler = config.checked_node("scheduler", scheduler)
        if optimizer and optimizer.get("lr") is not None and not 0 < optimizer["lr"] < math.inf:
            raise InvalidArgument("optimizer.lr", optimizer["lr"], "must be > 0")
        net, metrics = config.plain(net), config.plain(metrics)
        super().__init__(metrics, num_classes, monitor, monitor_mode)
        self.save_hyperparameters(logger=False)  # a checkpoint rebuilds this module from them
        self.net = build_net(net, num_classes)
        if channels_last:
            self.net.to(memory_format=torch.channels_last)

    def configure_model(self) -> None:
        if self.hparams.compile:
            device = self.trainer.strategy.root_device
            compiling.compile_net(self.net, self.hparams.compile_mode, device)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch  # y: class indices, or class weights (mixup, cutmix: data.augment)
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        self.track("train", loss, logits, y)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.tta(x) if self.hparams.tta_val else self(x)
        self.track("val", F.cross_entropy(logits, y), logits, y)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.tta(x)
        self.track("test", F.cross_entropy(logits, y), logits, y)

    def tta(self, x: Tensor) -> Tensor:
        """Logits averaged over the views of `tta` (tta.py)."""
        return tta_logits(self, x, self.hparams.tta, self.hparams.tta_shift)

    @property
    def tta_mode(self) -> str:
        return self.hparams.tta

    def configure_optimizers(self):
        if not self.hparams.optimizer:  # e.g. rebuilt from a checkpoint older than the setting
            raise UserError("module.optimizer is not set: e.g. module/optimizer=sgd")
        optimizer = instantiate(self.hparams.optimizer, params=self.parameters())
        scheduler = self.hparams.scheduler
        if not scheduler:
            return optimizer
        if "total_steps" in config.arguments(config.find_class(scheduler["_target_"])):
            total = self.trainer.estimated_stepping_batches
            if not math.isfinite(total):
                raise UserError("module.scheduler needs trainer.max_epochs or max_steps")
            scheduler = {**scheduler, "total_steps": int(total)}
        scheduler = instantiate(scheduler, optimizer=optimizer)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def build_net(node: Mapping, num_classes: int) -> nn.Module:
    """The network of `node` (a checkpoint's too): its `_target_` must be an nn.Module class, or
    a function annotated to return one, before it is called."""
    try:
        target = config.find_class(node["_target_"])
        made = target if isinstance(target, type) else config.returns(target)
        if not (isinstance(made, type) and issubclass(made, nn.Module)):
            raise InvalidArgument("_target_", node["_target_"], "makes no torch.nn.Module")
        return instantiate(node, num_classes=num_classes)
    except Exception as e:
        raise NestedBuildError("model", e) from e
