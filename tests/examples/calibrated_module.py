"""docs/fork.md's metric by code: the template's module with a calibration error of its own."""

import torch.nn.functional as F
from torchmetrics.classification import MulticlassCalibrationError

from cifar_amp.module import ImageClassifier


class WithCalibration(ImageClassifier):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.val_ece = MulticlassCalibrationError(self.hparams.num_classes)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.track("val", F.cross_entropy(logits, y), logits, y)
        self.val_ece.update(logits.softmax(-1), y)  # an update per step: host work per step
        self.log("val/ece", self.val_ece, on_epoch=True)
