"""Per-epoch history of the run's own metrics, and its training-curves picture.

Independent of the logger (also with `logger=none`): the values come from the trainer, not
from a logger's files. The history travels in every checkpoint, so a resumed run (same run
dir or a new one) draws the interrupted part too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from cifar_amp import metrics, plot

VAL = (metrics.VAL_LOSS, metrics.VAL_ACC)
TRAIN = (metrics.TRAIN_LOSS, metrics.TRAIN_ACC)


class TrainingCurves(Callback):
    """Writes `<dirpath>/history.json` at every epoch end and `<dirpath>/curves.png` at fit end
    (global rank zero): train/val loss and accuracy per epoch, and the learning rate of the
    first parameter group, sampled about `lr_points_per_epoch` times an epoch."""

    def __init__(self, dirpath: str, lr_points_per_epoch: int = 20) -> None:
        self.dirpath = Path(dirpath)
        self.lr_points_per_epoch = lr_points_per_epoch
        self.history: dict[str, list] = {plot.EPOCHS: [], plot.LR: []}
        self._val: dict[str, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        n = trainer.num_training_batches
        if not trainer.optimizers or not n or n == float("inf"):
            return
        every = max(1, int(n) // self.lr_points_per_epoch)
        if batch_idx % every == 0:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            self.history[plot.LR].append([trainer.current_epoch + batch_idx / n, float(lr)])

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._val = self._values(trainer, VAL)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        row = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        row.update(self._values(trainer, TRAIN))
        row.update(self._val)
        self._val = {}
        rows = self.history[plot.EPOCHS]
        rows[:] = [r for r in rows if r["epoch"] < row["epoch"]] + [row]
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            (self.dirpath / plot.HISTORY).write_text(json.dumps(self.history) + "\n")

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self.history[plot.EPOCHS]:
            plot.write(
                {self.dirpath.name: self.history},
                self.dirpath / "curves.png",
                title=str(self.dirpath),
            )

    @staticmethod
    def _values(trainer, keys) -> dict[str, float]:
        found = trainer.callback_metrics
        return {k: float(found[k]) for k in keys if k in found}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = state_dict["history"]
