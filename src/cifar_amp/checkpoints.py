"""A checkpoint, read once per command and as data only, since unpickling runs code
(trust_checkpoint lifts that), and checked against the run that starts from it."""

from pathlib import Path

import torch

from cifar_amp.errors import UserError

SETTINGS = "run_settings"  # the top-level key of what a resume must keep (resume.py writes it)
MODULE_CLASS = "module._target_"  # the LightningModule's class, of SETTINGS
MONITOR = "monitor.metric"  # the metric that ranked the run's checkpoints, of SETTINGS
# What trained the checkpoints that are older than the record of it.
TEMPLATE_MODULE = "cifar_amp.module.ImageClassifier"


def first_few(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def mismatch(saved: dict, ours: dict) -> list[str]:
    """How state dict `saved` differs from `ours`: one phrase per kind, naming the first keys."""
    shapes = {k: (tuple(saved[k].shape), tuple(v.shape)) for k, v in ours.items() if k in saved}
    bad = [f"{k} {a} vs {b}" for k, (a, b) in shapes.items() if a != b]
    found = {
        "missing from the checkpoint": sorted(set(ours) - set(saved)),
        "not in this model": sorted(set(saved) - set(ours)),
        "shapes (checkpoint vs model)": bad,
    }
    return [f"{what}: {first_few(keys)}" for what, keys in found.items() if keys]


def trained_by(module) -> dict:
    """The optimizer's and the schedule's classes (None: no schedule), by config key, from the
    module's config or a checkpoint's hyper_parameters: their states fit no other class."""
    if not module.get("optimizer"):  # a module never set to train (older, or built to test)
        return {}
    parts = ("optimizer", "scheduler")
    return {
        f"module.{k}._target_": getattr(module.get(k), "get", {}.get)("_target_") for k in parts
    }


class Checkpoint:
    """A checkpoint file (config key `key`), read once with one-line refusals, and what it says."""

    def __init__(self, path: str | Path, key: str = "ckpt_path", trust: bool = False) -> None:
        self.path, self.key, self.where = str(path), key, f"{key}={path}"
        if not Path(path).is_file():
            valid = ", or one of last, hpc" if key == "ckpt_path" else ""
            raise UserError(f"{self.where}: no such file (valid: a .ckpt file{valid})")
        try:  # with mmap, only the index is read now and each tensor when it is used
            data = torch.load(path, map_location="cpu", weights_only=not trust, mmap=True)
        except Exception as e:  # unpickling or zip errors
            if "Weights only load failed" not in str(e):
                raise UserError(f"{self.where} is truncated or not a checkpoint ({e!r})") from e
            found = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(path)) or e
            raise UserError(
                f"{self.where} holds {found}, which no template checkpoint holds: not loaded, as "
                "unpickling it could run code. If you trust the file: trust_checkpoint=true"
            ) from None
        if not isinstance(data, dict) or "state_dict" not in data:
            raise UserError(f"{self.where} is not a Lightning checkpoint (no 'state_dict')")
        self.data, self.hparams = data, data.get("hyper_parameters", {})
        # Older checkpoints have no record; those of 71c3482 hold their classes in hparams.
        older = trained_by(self.hparams) | {MODULE_CLASS: TEMPLATE_MODULE}
        self.settings: dict = older | data.get(SETTINGS, {})

    def check_settings(self, settings: dict) -> None:
        """Refuse to continue with other settings, naming the first that differs."""
        for key, theirs in self.settings.items():
            if key in settings and settings[key] != theirs:
                # A class is chosen by a config group's option (module/optimizer=sgd), not typed.
                group = key.removesuffix("._target_").replace(".", "/")
                by_option = key.endswith("._target_") and key != MODULE_CLASS
                same = f"the {group} it was trained with" if by_option else None
                raise UserError(
                    f"{self.where} was trained with {key}={theirs}; this run asks for "
                    f"{key}={settings[key]}. A resume must keep {', '.join(settings)}: resume "
                    f"with {same or f'{key}={theirs}'}, or start a new run"
                )

    def check_fits(self, module, num_classes: int) -> None:
        """Refuse another number of classes or another network, naming the keys that differ."""
        if (theirs := self.hparams.get("num_classes")) not in (None, num_classes):
            raise UserError(
                f"{self.where} was trained for {theirs} classes; data.dataset has {num_classes}"
            )
        if problems := mismatch(self.data["state_dict"], module.state_dict()):
            raise UserError(
                f"{self.where} does not fit this model (check model=... and module.metrics): "
                + "; ".join(problems)
            )
