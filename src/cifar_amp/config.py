"""Config schemas, generated from the constructors they configure.

A constructor's signature is its schema: :func:`schema` turns it into a dataclass (`_target_`
plus every keyword argument, typed, with the code's default). A group's YAML starts from the
schema of the class it builds, named by its import path::

    defaults:
      - /schema/cifar_amp.models.speednet.SpeedNet@_here_

and holds only what differs. :func:`register` finds those lines in the YAML files and stores
each schema in Hydra's ConfigStore, so adding a model or a DataModule takes its class and its
YAML, and nothing else. ``model.<arg>=...`` then works without ``+``, and a typo or a wrong type
fails at composition. Range checks live in the constructors; build.py reports them by key.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import secrets
import types
import typing
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import get_object
from omegaconf import MISSING, OmegaConf

from cifar_amp import metrics

RUN_ID = secrets.token_hex(3)  # one per process; `${run_id:}` in run dir names
# By config group: the arguments build.py passes, decided by another part (the number of classes
# by the data, the layout by the precision, ...), so not settings of their own.
PASSED_BY_BUILD = {
    "model": ("num_classes",),
    "data": ("channels_last",),
    "module": ("net", "num_classes", "channels_last", "data_meta"),
    "trainer": ("precision", "callbacks", "logger", "default_root_dir"),
}
SCHEMA_LINE = re.compile(r"^\s*-\s*/schema/([\w.]+)@_here_\s*(?:#.*)?$", re.M)
_PLAIN = (int, float, bool, str)


@dataclass(frozen=True)
class Nested:
    """`Annotated[dict, Nested(cls)]`: the argument is a node of `cls`'s own arguments."""

    target: Any
    exclude: tuple[str, ...] = ()


def _field_type(hint: Any) -> Any:
    """The closest type OmegaConf can check: a plain type, Optional of one, a dataclass, else Any."""
    if hint in _PLAIN or dataclasses.is_dataclass(hint):
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2 and _field_type(rest[0]) is not Any:
            return Optional[_field_type(rest[0])]
    if origin is typing.Literal and all(isinstance(a, str) for a in args):
        return str
    return Any


def schema(target: Any, exclude: tuple[str, ...] = (), with_target: bool = True) -> type:
    """A dataclass of `target`'s keyword arguments: `_target_`, then each argument, typed, with
    its default (a required one is MISSING: the YAML or the user sets it)."""
    fn = target.__init__ if inspect.isclass(target) else target
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: list[tuple] = []
    if with_target:
        path = f"{target.__module__}.{target.__qualname__}"
        fields.append(("_target_", str, field(default=path)))
    for name, p in inspect.signature(target).parameters.items():
        if name in exclude or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint = hints.get(name, Any)
        nested = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Nested)), None)
        if nested:
            sub = schema(nested.target, nested.exclude, with_target=False)
            fields.append((name, sub, field(default_factory=sub)))
            continue
        if typing.get_origin(hint) is typing.Annotated:
            hint = typing.get_args(hint)[0]
        typ, value = _field_type(hint), p.default
        if value is inspect.Parameter.empty:  # required: the YAML or the user sets it
            value = MISSING
        elif name == "seed":  # one seed for the whole run: the top-level `seed`
            typ, value = Any, "${seed}"
        elif isinstance(value, (tuple, list, typing.Mapping)):
            value = dict(value) if isinstance(value, typing.Mapping) else list(value)
            typ = typ if dataclasses.is_dataclass(typ) else Any
        fields.append((name, typ, field(default_factory=functools.partial(lambda v: v, value))))
    return make_dataclass(f"{getattr(target, '__name__', 'Target')}Schema", fields)


@dataclass
class TrainConfig:
    """The top of `configs/train.yaml`; each part is a `_target_` node built by build.py."""

    data: Any = None  # a LightningDataModule (configs/data/)
    model: Any = None  # a plain nn.Module (configs/model/); its config is saved in checkpoints
    module: Any = None  # the LightningModule around the model (configs/module/)
    precision: Any = None  # cifar_amp.precision.Precision (configs/precision/)
    trainer: Any = None  # lightning.Trainer arguments (configs/trainer/)
    callbacks: Any = field(default_factory=dict)  # name -> Lightning callback
    logger: Any = field(default_factory=dict)  # name -> Lightning logger
    run_dir: str = "${hydra:runtime.output_dir}"  # checkpoints, logs, metrics.json
    seed: int = 42  # seeds the split, augmentation and initialisation
    ckpt_path: Optional[str] = None  # resume from this checkpoint (or `last`, `hpc`)
    # Unpickle checkpoints as anything, not as data only: for a file you trust that holds
    # types a checkpoint of this template never holds (checkpoints.py).
    trust_checkpoint: bool = False
    test: bool = True  # test the best checkpoint after fit
    # Returned by train.py for sweepers (Optuna maximises it); a key of metrics.json.
    optimized_metric: str = metrics.VAL_ACC_BEST


@dataclass
class EvalConfig:
    """The top of `configs/eval.yaml`: the network is rebuilt from the checkpoint."""

    data: Any = None
    precision: Any = None
    trainer: Any = None
    logger: Any = field(default_factory=dict)
    run_dir: str = "${hydra:runtime.output_dir}"
    seed: int = 42
    ckpt_path: Optional[str] = None  # required: the checkpoint to test
    trust_checkpoint: bool = False  # as in train.yaml


# What a checkpoint carries, which the entries that start from one (eval, predict, export) take
# from it rather than from their config: by train.yaml's key.
FROM_CHECKPOINT = {
    "model": "the network",
    "module": "the module's settings (num_classes, tta; its optimizer was training's)",
    "data": "the data's class names, normalisation and image size",
}


def sqlite_url(path: str) -> str:
    """``${sqlite:<file>}`` -> a SQLAlchemy URL, creating the file's folder (SQLite does not)."""
    db = Path(path).expanduser().resolve()
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def register(config_dir: Path, entries: dict[str, type] | None = None) -> None:
    """Into Hydra's ConfigStore: the entry configs' schemas (`<name>_schema`) and the schema of
    every class a YAML file under `config_dir` names (see the module doc); the YAML resolvers.
    Called where the app starts (cli.py, the tests' compose fixture). Idempotent."""
    cs = ConfigStore.instance()
    for name, node in {"train": TrainConfig, "eval": EvalConfig, **(entries or {})}.items():
        # Open while composing, so that an extra's config may add a top-level key of its own
        # (`init_from`); Hydra closes the composed config, so a typo still fails.
        base = OmegaConf.structured(node)
        OmegaConf.set_struct(base, False)
        cs.store(name=f"{name}_schema", node=base)
    for f in sorted(Path(config_dir).rglob("*.yaml")):
        group = f.relative_to(config_dir).parts[0]
        for path in SCHEMA_LINE.findall(f.read_text()):
            node = schema(get_object(path), PASSED_BY_BUILD.get(group, ()))
            cs.store(group="schema", name=path, node=node)
    resolvers = {"metric": metrics.resolve, "sqlite": sqlite_url, "run_id": lambda: RUN_ID}
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
