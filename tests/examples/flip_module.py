"""docs/fork.md's metric by code: the template's module with a metric that no config can say, as
it needs more than (logits, class indices): how often the predicted class stays the same when
an image is mirrored, which takes one more forward pass of the network."""

import torch.nn.functional as F
from torchmetrics import MeanMetric

from cifar_amp.module import ImageClassifier


class WithFlipAgreement(ImageClassifier):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.val_flip_agreement = MeanMetric()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.track("val", F.cross_entropy(logits, y), logits, y)
        mirrored = self(x.flip(-1))  # the images' mirror views: a second forward pass
        same = logits.argmax(-1) == mirrored.argmax(-1)
        self.val_flip_agreement.update(same.float())  # an update per step: host work per step
        self.log("val/flip_agreement", self.val_flip_agreement, on_epoch=True)
