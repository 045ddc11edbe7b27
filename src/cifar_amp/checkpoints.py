"""A checkpoint, read once per command and as data only, since unpickling runs code
(trust_checkpoint lifts that), and checked against the run that starts from it. The class names
it holds are data too: one is imported only from the packages a run may use (`PACKAGES`)."""

import importlib.util
import site
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

import torch

from cifar_amp.errors import UserError

SETTINGS = "run_settings"  # the top-level key of what a resume must keep (resume.py writes it)
MODULE_CLASS = "module._target_"  # the LightningModule's class, of SETTINGS
MONITOR = "monitor.metric"  # the metric that ranked the run's checkpoints, of SETTINGS
# What trained the checkpoints that are older than the record of it.
TEMPLATE_MODULE = "cifar_amp.module.ImageClassifier"
# The installed packages whose classes a checkpoint may name (module, network, metrics, optimizer,
# schedule): those the configs name. Besides them, a name read from a checkpoint imports only
# this package and your own code (user_code); any other module, the standard library's too, is
# refused before it is imported: importing runs its code. Add a package you trust here.
PACKAGES = ("torch", "torchvision", "torchmetrics", "timm", "lightning")
OWN_PACKAGE = __name__.partition(".")[0]  # not spelled out: a fork renames it (make rename)


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


def interpreter_dirs() -> list[Path]:
    """Where the interpreter's own modules lie: the standard library and site-packages."""
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    dirs = {sysconfig.get_path(k) for k in keys} | {*site.getsitepackages()}
    dirs.add(site.getusersitepackages())
    return [Path(d).resolve() for d in dirs if d]


def user_code(top: str) -> bool:
    """Whether top-level module `top` is your own code: found in a folder of sys.path that is not
    the interpreter's (standard library, site-packages), such as PYTHONPATH's, the command's or an
    editable install's source folder. pytest's `pythonpath` option puts tests/ and tests/examples/
    on sys.path, so their classes count as a fork's. find_spec of a top-level name runs none of
    its code. A name found nowhere is allowed: nothing runs, and its lookup says it is missing."""
    if not top.isidentifier() or top in sys.stdlib_module_names:
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # e.g. __main__, whose spec is unset
        return False
    if spec is None:
        return True
    found = [spec.origin] if spec.has_location else list(spec.submodule_search_locations or ())
    if not found:  # a built-in or frozen module: the interpreter's
        return False
    interpreter = interpreter_dirs()
    return not any(Path(f).resolve().is_relative_to(d) for f in found for d in interpreter)


def may_import(path: str) -> bool:
    """Whether dotted `path`, a class name read from a checkpoint, may be imported."""
    top = path.partition(".")[0]
    return top == OWN_PACKAGE or top in PACKAGES or user_code(top)


def targets(node, key: str) -> dict[str, str]:
    """Each `_target_` name in `node` (nested mappings and lists), by its dotted key under `key`:
    Hydra's instantiate imports the nested ones too."""
    if isinstance(node, Mapping):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        return {}
    found = {}
    for k, v in items:
        if k == "_target_" and isinstance(v, str):
            found[f"{key}._target_"] = v
        else:
            found |= targets(v, f"{key}.{k}")
    return found


class Checkpoint:
    """A checkpoint file (config key `key`), read once with one-line refusals, and what it says."""

    def __init__(self, path: str | Path, key: str = "ckpt_path", trust: bool = False) -> None:
        self.path, self.key, self.where = str(path), key, f"{key}={path}"
        self.trust = trust
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

    def check_class_names(self) -> None:
        """Refuse, before anything is imported, a class name it holds (its settings' and each
        `_target_` of the module's arguments, the network's, metrics', optimizer's among them)
        whose module is not one a run may use (`may_import`). Unless the file is trusted:
        unpickling it could run any code then."""
        if self.trust:
            return
        named = {k: v for k, v in self.settings.items() if k.endswith("._target_") and v}
        named |= targets(self.hparams, "module")
        for key, path in named.items():
            if not isinstance(path, str) or not may_import(path):
                allowed = ", ".join((OWN_PACKAGE, *PACKAGES))
                raise UserError(
                    f"{self.where} names {path} at {key}: the module "
                    f"{str(path).partition('.')[0]} is not imported, as a checkpoint's class "
                    f"names import only {allowed} (checkpoints.PACKAGES) and your own code on "
                    "PYTHONPATH. If you trust the file: trust_checkpoint=true"
                )

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
