"""Config schemas, generated from the constructors they configure.

A constructor's signature is its schema: :func:`schema` turns it into a dataclass (`_target_`
plus every keyword argument, typed, with the code's default), which :func:`register` puts in
Hydra's ConfigStore as ``schema/<group>/<Name>``. A group's YAML starts from it
(``defaults: [/schema/model/SpeedNet@_here_]``) and holds only what differs, so
``model.<arg>=...`` works without ``+`` and a typo or a wrong type fails at composition.
Range checks live in the constructors, beside the defaults; the builders (build.py) report
them by config key. The Trainer's schema comes from ``lightning.Trainer.__init__`` itself.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import secrets
import types
import typing
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Optional

import lightning
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from cifar_amp import metrics

RUN_ID = secrets.token_hex(3)  # one per process; `${run_id:}` in run dir names
_PLAIN = (int, float, bool, str)

# Trainer arguments set by the template itself, not by `trainer.*`: precision comes from the
# `precision` group, callbacks and loggers from theirs, the root dir is the run dir.
TRAINER_SET_BY_TEMPLATE = ("precision", "callbacks", "logger", "default_root_dir")
# Where the template's Trainer defaults differ from Lightning's (documented in
# configs/trainer/default.yaml's header).
TRAINER_DEFAULTS = {
    "max_epochs": 10,
    "num_sanity_val_steps": 0,
    # Checkpoints are written atomically (temp file + fsync + rename): see reliability/.
    "plugins": [{"_target_": "cifar_amp.reliability.atomic_io.AtomicCheckpointIO"}],
}


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


def _default(value: Any) -> Any:
    """A constructor default as config: partials become `_partial_` nodes, tuples lists."""
    if isinstance(value, functools.partial):
        fn = value.func
        return {
            "_target_": f"{fn.__module__}.{fn.__qualname__}",
            "_partial_": True,
            **value.keywords,
        }
    if isinstance(value, tuple):
        return list(value)
    return value


def schema(
    target: Any,
    exclude: tuple[str, ...] = (),
    defaults: dict[str, Any] | None = None,
    with_target: bool = True,
    nested: dict[str, type] | None = None,
) -> type:
    """A dataclass schema for `target`'s keyword arguments (see the module docstring).

    `exclude`: arguments the builders pass at run time (e.g. `num_classes`, decided by the
    data). `defaults`: where the template's default differs from the constructor's.
    """
    defaults, nested = defaults or {}, nested or {}
    fn = target.__init__ if inspect.isclass(target) else target
    hints = typing.get_type_hints(fn)
    fields: list[tuple] = []
    if with_target:
        path = f"{target.__module__}.{target.__qualname__}"
        fields.append(("_target_", str, field(default=path)))
    for name, p in inspect.signature(target).parameters.items():
        if name in exclude or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in nested:
            fields.append((name, nested[name], field(default_factory=nested[name])))
            continue
        typ = _field_type(hints.get(name, Any))
        if name in defaults:
            value = defaults[name]
            typ = Any if isinstance(value, (dict, list)) else typ
        elif p.default is inspect.Parameter.empty:  # required: the YAML or the user sets it
            fields.append((name, typ, field(default=MISSING)))
            continue
        else:
            value = _default(p.default)
        if isinstance(value, (dict, list)) and not dataclasses.is_dataclass(typ):
            typ = Any
        fields.append((name, typ, field(default_factory=lambda v=value: v)))
    name = getattr(target, "__name__", "Target")
    return make_dataclass(f"{name}Schema", fields)


@dataclass
class TrainConfig:
    """The top of `configs/train.yaml`; each part is a `_target_` node built by build.py."""

    data: Any = None  # a LightningDataModule (configs/data/)
    model: Any = None  # a plain nn.Module (configs/model/); saved in every checkpoint
    module: Any = None  # the LightningModule around the model (configs/module/)
    precision: Any = None  # cifar_amp.precision.Precision (configs/precision/)
    trainer: Any = None  # lightning.Trainer arguments (configs/trainer/)
    callbacks: Any = field(default_factory=dict)  # name -> Lightning callback
    logger: Any = field(default_factory=dict)  # name -> Lightning logger
    run_dir: str = "${hydra:runtime.output_dir}"  # checkpoints, logs, metrics.json
    seed: int = 42  # seeds the split, augmentation and initialisation
    ckpt_path: Optional[str] = None  # resume from this checkpoint
    # Fine-tune: start a new run from this checkpoint's network weights only (finetune.py)
    init_from: Optional[str] = None
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


@dataclass
class PredictConfig:
    """The top of `configs/predict.yaml`: network and class names come from the checkpoint."""

    precision: Any = None
    trainer: Any = None
    run_dir: str = "${hydra:runtime.output_dir}"  # predictions.csv
    ckpt_path: Optional[str] = None  # required: the checkpoint to predict with
    input: Optional[str] = None  # required: a folder of images, an image file, a CIFAR batch file
    batch_size: int = 256  # images per forward pass
    tta: Optional[str] = None  # test-time augmentation; null: the checkpoint's (module.tta)


@dataclass
class ExportConfig:
    """The top of `configs/export.yaml`: export a checkpoint's network, verified on `input`."""

    run_dir: str = "${hydra:runtime.output_dir}"
    ckpt_path: Optional[str] = None  # required: the checkpoint to export
    format: str = "onnx"  # onnx | torch_export
    output: Optional[str] = None  # null: <run_dir>/model.onnx or model.pt2
    # Real images to verify the exported model on: a folder, an image file, a CIFAR batch file.
    input: str = "data/cifar-10-batches-py/test_batch"
    verify_images: int = 64  # how many of them (at this batch size and at batch size 1)
    # Exported logits must be within atol + rtol * |PyTorch's| of the PyTorch module's.
    atol: float = 1e-4
    rtol: float = 1e-4
    tta: Optional[str] = None  # test-time augmentation built in; null: the checkpoint's


def sqlite_url(path: str) -> str:
    """``${sqlite:<file>}`` -> a SQLAlchemy URL, creating the file's folder (SQLite does not),
    so that the Optuna study of ``hparams_search`` can live under ``logs/`` on a fresh clone."""
    db = Path(path).expanduser().resolve()
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def register() -> None:
    """Schemas into Hydra's ConfigStore and the YAML resolvers; called where the app starts
    (cli.py, and the tests' compose fixture). Idempotent."""
    from cifar_amp import data, models, module, precision

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    cs.store(name="predict_schema", node=PredictConfig)
    cs.store(name="export_schema", node=ExportConfig)
    for name in models.__all__:  # num_classes: the data decides it
        cs.store(
            group="schema/model", name=name, node=schema(getattr(models, name), ("num_classes",))
        )
    for name in data.__all__:
        cls = getattr(data, name)
        if inspect.isclass(cls) and issubclass(cls, lightning.LightningDataModule):
            # channels_last: the precision decides it (build.py)
            cs.store(
                group="schema/data",
                name=name,
                node=schema(cls, ("channels_last",), {"seed": "${seed}"}),
            )
    # net, num_classes, channels_last, data_meta: passed by build.py from model, data, precision
    excluded = ("net", "num_classes", "channels_last", "data_meta")
    cs.store(
        group="schema/module", name="ImageClassifier", node=schema(module.ImageClassifier, excluded)
    )
    scaler = schema(torch.amp.GradScaler, ("device",), with_target=False)
    node = schema(precision.Precision, nested={"scaler": scaler})
    cs.store(group="schema/precision", name="Precision", node=node)
    trainer = schema(lightning.Trainer, TRAINER_SET_BY_TEMPLATE, TRAINER_DEFAULTS)
    cs.store(group="schema/trainer", name="Trainer", node=trainer)
    resolvers = {"metric": metrics.resolve, "sqlite": sqlite_url, "run_id": lambda: RUN_ID}
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
