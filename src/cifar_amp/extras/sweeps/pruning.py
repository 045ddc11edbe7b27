"""Extra (hparams_search=optuna, docs/scaling.md): each epoch's `monitor` goes to this job's
Optuna trial, and training stops early when the pruner says so. Not optuna-integration's
callback: its TrialPruned inside Lightning's hook is a crash (no test, no metrics.json, a FAILED
tracker run); here training stops as EarlyStopping would and the trial records PRUNED_AT."""

from __future__ import annotations

import logging

from hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper.trial import (
    PRUNED_AT,
    configured_pruner,
    current_trial,
)
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)


class OptunaPruning(Callback):
    """`monitor` is reported once per epoch: the pruner compares trials of any batch size."""

    def __init__(self, monitor: str) -> None:
        self.monitor = monitor
        self.pruner = configured_pruner()  # here, where the job's Hydra config is
        self.trial = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Here, not in __init__: a process that ddp_spawn starts opens the trial itself.
        if stage == "fit" and self.trial is None:
            self.trial = current_trial(self.pruner)
            if self.trial is None:
                log.warning(
                    "Pruning: this job runs no Optuna trial with a storage; it is not pruned"
                )

    def on_validation_end(self, trainer, pl_module) -> None:
        score = trainer.callback_metrics.get(self.monitor)
        if self.trial is None or trainer.sanity_checking or score is None:
            return
        prune, epoch = False, trainer.current_epoch
        if trainer.is_global_zero:  # decides for all ranks
            self.trial.report(float(score), step=epoch)
            prune = self.trial.should_prune()
            if prune:
                self.trial.set_user_attr(PRUNED_AT, epoch)
                log.info(
                    f"Pruning: trial {self.trial.number} stops after epoch {epoch} "
                    f"({self.monitor}={score:.4f})"
                )
        if trainer.strategy.broadcast(prune):
            trainer.should_stop = True
