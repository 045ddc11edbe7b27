"""docs/fork.md's own LightningModule: a subclass of Lightning's class itself, not of the
template's ImageClassifier or LeanModule, with its own loss and metric, logged as Lightning logs
them. What each command asks of it is the table there; its config: configs/module/own.yaml."""

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from cifar_amp import metrics
from cifar_amp.module import build_net


class OwnClassifier(L.LightningModule):
    def __init__(self, net: dict, num_classes: int, channels_last: bool = False, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()  # eval.py, predict, export and a resume rebuild it from them
        self.net = build_net(net, num_classes)  # build_net: only an nn.Module class is called
        if channels_last:  # the precision's choice of memory layout
            self.net.to(memory_format=torch.channels_last)
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log(metrics.TRAIN_LOSS, loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.evaluate("val", batch, self.val_acc)

    def test_step(self, batch, batch_idx):
        self.evaluate("test", batch, self.test_acc)

    def evaluate(self, stage, batch, accuracy):
        x, y = batch
        logits = self(x)
        accuracy(logits, y)
        self.log(metrics.key(stage, metrics.LOSS), F.cross_entropy(logits, y))
        self.log(metrics.key(stage, metrics.ACC), accuracy)  # val/acc: what the best is chosen by

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
