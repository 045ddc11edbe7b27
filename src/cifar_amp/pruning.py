"""Extra (hparams_search=optuna, docs/scaling.md): each epoch's validation accuracy goes to the
Optuna trial this job runs, and training stops early when the study's pruner says so.

Not optuna-integration's PyTorchLightningPruningCallback: in one process it raises TrialPruned
inside Lightning's validation hook, which Lightning handles as a crash: the job ends without
testing or metrics.json, and MLflow/W&B mark the run FAILED (measured: docs/scaling.md). Here
training stops as EarlyStopping would, the job ends normally, and the trial records the epoch
(PRUNED_AT), from which the sweeper records it as PRUNED. Under DDP rank zero decides and tells
the others."""

from __future__ import annotations

import logging

from lightning.pytorch.callbacks import Callback

from hydra_plugins.optuna_asktell_sweeper.trial import PRUNED_AT, configured_pruner, current_trial

log = logging.getLogger(__name__)


class OptunaPruning(Callback):
    """Args:
    monitor: the metric reported once per epoch (the pruner compares trials at the same
        epoch, whatever their batch size).
    """

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
        if trainer.is_global_zero:
            self.trial.report(float(score), step=epoch)
            prune = self.trial.should_prune()
            if prune:
                self.trial.set_user_attr(PRUNED_AT, epoch)
                log.info(
                    "Pruning: trial %d stops after epoch %d (%s=%.4f)",
                    self.trial.number,
                    epoch,
                    self.monitor,
                    score,
                )
        if trainer.strategy.broadcast(prune):
            trainer.should_stop = True
