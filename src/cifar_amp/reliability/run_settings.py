"""The settings a resume must keep, recorded in every checkpoint and compared before a resume.

A resume continues the schedule, the loader's position (in batches) and the optimizer and
GradScaler state: with another batch size, precision, model or dataset none of these mean what
they meant, so such a resume is refused, naming the setting. Checkpoints written before the
record existed carry none and are resumed as before.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from cifar_amp.errors import UserError
from cifar_amp.reliability import preflight

KEY = "run_settings"  # top-level key of the checkpoint dict


def of(cfg) -> dict[str, Any]:
    """This run's values, by the config key a user would change."""
    return {
        "data.dataset": cfg.data.get("dataset", cfg.data._target_),
        "data.batch_size": cfg.data.get("batch_size"),
        "precision": cfg.precision.name,
        "model._target_": cfg.model["_target_"],
    }


class RecordRunSettings(Callback):
    """Writes `settings` into every checkpoint, under `run_settings`."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = dict(settings)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[KEY] = self.settings


def check(ckpt_path: str, settings: dict[str, Any]) -> None:
    """Refuse to resume `ckpt_path` with settings other than those it was trained with."""
    recorded = preflight.load_checkpoint(ckpt_path).get(KEY, {})
    for key, ours in settings.items():
        if key in recorded and recorded[key] != ours:
            theirs = recorded[key]
            raise UserError(
                f"ckpt_path={ckpt_path} was trained with {key}={theirs}; this run asks for "
                f"{key}={ours}. A resume must keep {', '.join(settings)}: resume with "
                f"{key}={theirs}, or start a new run"
            )
