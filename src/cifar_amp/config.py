"""Schemas from the constructors they configure: a typo or wrong type fails at composition."""

import collections
import dataclasses
import importlib
import inspect
import re
import runpy
import secrets
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from cifar_amp import metrics

EXTRAS = Path(__file__).parent / "extras"  # an extra is a folder there (docs/fork.md)
RUN_ID = secrets.token_hex(3)  # one per process; `${run_id:}` in run dir names
# By config group, the constructor arguments that are not settings: other parts decide them and
# pass them (build.py; the module, an optimizer's and schedule's), so the schemas leave them out.
NOT_SETTINGS = {
    "model": ("num_classes",),
    "data": ("channels_last",),
    "module": ("net", "num_classes", "channels_last", "monitor", "monitor_mode"),
    "module/optimizer": ("params",),
    "module/scheduler": ("optimizer", "total_steps", "epochs", "steps_per_epoch", "last_epoch"),
    "trainer": ("precision", "callbacks", "logger", "default_root_dir"),
}
SCHEMA_LINE = re.compile(r"^\s*-\s*/schema/([\w.]+)@_here_\s*(?:#.*)?$", re.M)
# An argument annotated `Annotated[dict, Nested(cls, exclude)]` is a node of `cls`'s arguments.
Nested = collections.namedtuple("Nested", ["target", "exclude"], defaults=[()])


def _field_type(hint: Any) -> Any:
    """The closest type OmegaConf checks: a plain type, Optional of one, a dataclass, else Any."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (int, float, bool, str) or dataclasses.is_dataclass(hint):
        return hint
    # torch.optim's `lr: float | Tensor`: a config can only give the number. (torch is looked up,
    # not imported: Hydra's plugin scan imports this module; a hint naming Tensor imported it.)
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    if origin in (typing.Union, types.UnionType) and tensor is not None and tensor in args:
        return _field_type(typing.Union[tuple(a for a in args if a is not tensor)])
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _field_type(next(a for a in args if a is not type(None)))
        return Any if inner is Any else Optional[inner]
    return str if origin is typing.Literal and all(isinstance(a, str) for a in args) else Any


def arguments(target: Any) -> dict[str, tuple[inspect.Parameter, Any, Any]]:
    """`target`'s named arguments: (parameter, type hint, hint with Annotated's metadata). A
    class's **kwargs are those of its base's __init__ (a subclass that passes the rest on)."""
    fn = target.__init__ if inspect.isclass(target) else target
    hints, extras = typing.get_type_hints(fn), typing.get_type_hints(fn, include_extras=True)
    out, rest = {}, False
    for name, p in inspect.signature(target).parameters.items():
        rest |= p.kind == p.VAR_KEYWORD
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            out[name] = (p, hints.get(name, Any), extras.get(name))
    if rest and inspect.isclass(target):
        base = next(c for c in target.__mro__[1:] if "__init__" in vars(c))
        out = (arguments(base) if base is not object else {}) | out
    return out


def find_class(path: str) -> Any:
    """The object at dotted `path` (`package.module.Class`), found by importing its module and
    nothing else: a path that names nothing is a LookupError in one line, a missing package the
    ModuleNotFoundError that names it."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            found = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # not a module: an attribute of a shorter one, or nothing
            raise
        for attr in parts[i:]:
            if not hasattr(found, attr):
                raise LookupError(f"{path}: {name} has no {'.'.join(parts[i:])}")
            found = getattr(found, attr)
        return found
    raise LookupError(f"{path}: no such module")


def returns(fn: Any) -> Any:
    """What callable `fn` is annotated to return (None if it says not)."""
    try:
        return typing.get_type_hints(fn).get("return")
    except Exception:  # not a function, or a hint that does not resolve
        return None


def plain(node: Any) -> Any:
    """`node` (a dict or DictConfig, or None) as plain, resolved data: what a checkpoint keeps."""
    if node is None:
        return None
    return OmegaConf.to_container(OmegaConf.create(node), resolve=True)


def checked_node(arg: str, node: Any) -> dict | None:
    """`node`, a `_target_` node of a constructor's argument `arg` (e.g. the module's optimizer),
    as plain data, once its class is found and takes each of its keys."""
    from cifar_amp.errors import InvalidArgument  # errors imports Lightning: see _target

    if node is None:
        return None
    if not (isinstance(node, typing.Mapping) and "_target_" in node):
        raise InvalidArgument(arg, repr(node), f"choose one with module/{arg}=<option>")
    takes = arguments(find_class(node["_target_"]))
    if bad := [k for k in node if k not in {"_target_", *takes}]:
        raise InvalidArgument(
            f"{arg}.{bad[0]}", node[bad[0]], f"{node['_target_']} takes no {bad[0]}"
        )
    return plain(node)


def schema(target: Any, exclude: tuple[str, ...] = (), path: str | None = None) -> type:
    """A dataclass of `target`'s keyword arguments, typed, with their defaults (MISSING if none);
    `_target_` is `path` (as a YAML file names the class), unless None: a nested node's."""
    columns = [("_target_", str, field(default=path))] if path else []
    for name, (p, hint, extra) in arguments(target).items():
        if name in exclude:
            continue
        typ, value = _field_type(hint), p.default
        if isinstance(nested := getattr(extra, "__metadata__", [None])[0], Nested):
            typ = schema(nested.target, nested.exclude)
            value = typ()
        elif value is p.empty:  # a required argument, which the YAML or the user sets
            value = MISSING
        elif name == "seed":  # every seed of a run follows its top-level `seed`
            typ, value = Any, "${seed}"
        elif isinstance(value, (tuple, list, typing.Mapping)):
            value = dict(value) if isinstance(value, typing.Mapping) else list(value)
            typ = typ if dataclasses.is_dataclass(typ) else Any
        columns.append((name, typ, field(default_factory=lambda v=value: v)))
    return dataclasses.make_dataclass(f"{getattr(target, '__name__', 'Target')}Schema", columns)


def schema_node(target: Any, exclude: tuple[str, ...] = (), path: str | None = None):
    """`schema(...)` as a config node in which an argument whose default is a mapping (a name ->
    settings table, such as the module's `metrics`) takes new keys without Hydra's `+`."""
    cfg = OmegaConf.structured(schema(target, exclude, path))
    for name, (p, _, _) in arguments(target).items():
        if name not in exclude and isinstance(p.default, typing.Mapping):
            OmegaConf.set_struct(cfg[name], False)
    return cfg


@dataclass
class Monitor:
    """The validation metric that ranks a run's checkpoints, `val/<metric>`: the best checkpoint
    (callbacks.model_checkpoint), early stopping, `val/<metric>_best` in metrics.json, and what
    train.py returns to sweepers (`optimized_metric`). A LeanModule checks it before training."""

    metric: str = metrics.ACC  # a name of module.metrics, or `loss`
    mode: str = "max"  # max: higher is better (accuracy, F1); min: lower is (loss)


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
    trust_checkpoint: bool = False  # unpickle any object a checkpoint holds, for files you trust
    test: bool = True  # test the best checkpoint after fit
    monitor: Monitor = field(default_factory=Monitor)
    optimized_metric: str = "${best:${monitor.metric}}"  # what train.py returns, for sweepers


# The top of `configs/eval.yaml` is train.yaml's (the same Field objects) less fit's own fields.
FIT_ONLY = ("model", "module", "test", "monitor", "optimized_metric")
EvalConfig = dataclasses.make_dataclass(
    "EvalConfig", [(f.name, f.type, f) for f in fields(TrainConfig) if f.name not in FIT_ONLY]
)
# What a checkpoint holds that every entry starting from one (eval.py, an extra's) takes from it.
FROM_CHECKPOINT = {
    "model": "the network",
    "module": "the module's settings (num_classes, tta; its optimizer was training's)",
    "data": "the data's class names, normalisation and image size",
}


def register(config_dir: Path, entries: dict[str, type] | None = None) -> None:
    """Store the entry configs' schemas, each schema that a YAML file names, and the resolvers."""
    cs = ConfigStore.instance()
    for name, node in {"train": TrainConfig, "eval": EvalConfig, **(entries or {})}.items():
        # Open while composing, so that an extra may add a top-level key; Hydra closes it after.
        cs.store(name=f"{name}_schema", node=OmegaConf.structured(node, flags={"struct": False}))
    for root in (Path(config_dir), *sorted(EXTRAS.glob("*/configs"))):
        for f in sorted(root.rglob("*.yaml")):
            group = "/".join(f.relative_to(root).parts[:-1])  # module/optimizer, else module's
            exclude = NOT_SETTINGS.get(group, NOT_SETTINGS.get(group.split("/")[0], ()))
            for path in SCHEMA_LINE.findall(f.read_text()):
                cs.store(
                    group="schema", name=path, node=schema_node(_target(path, f), exclude, path)
                )
    OmegaConf.register_new_resolver("metric", metrics.resolve, replace=True)
    # ${monitored:${monitor.metric}} -> val/acc; ${best:${monitor.metric}} -> val/acc_best
    OmegaConf.register_new_resolver(
        "monitored", lambda name: metrics.key("val", name), replace=True
    )
    OmegaConf.register_new_resolver("best", metrics.best, replace=True)
    OmegaConf.register_new_resolver("run_id", lambda: RUN_ID, replace=True)


def _target(path: str, named_in: Path) -> Any:
    """The class at `path`, or one line if it imports an extra whose folder was deleted."""
    module, _, name = path.rpartition(".")
    try:  # importlib, as Hydra's get_object would log an error of its own before ours
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if (said := deleted_extra(e, named_in)) is None:
            raise
        # Imported here: errors.py imports Lightning, and Hydra's plugin scan imports this module.
        from cifar_amp.errors import UserError

        raise UserError(said) from None


def deleted_extra(e: ModuleNotFoundError, named_in: Path | None = None) -> str | None:
    """What to say when `e` is an import of an extra whose folder was deleted, else None."""
    prefix, _, rest = (e.name or "").partition(".extras.")
    gone = rest.split(".")[0]
    if prefix != __package__ or not gone or (EXTRAS / gone).is_dir():
        return None
    inits = sorted(EXTRAS.glob("*/__init__.py"))  # each says the extras it NEEDS
    users = [p.parent.name for p in inits if gone in runpy.run_path(str(p)).get("NEEDS", ())]
    who = f"{' and '.join(users)} need it: delete their folders too"
    if not users:  # no extra declares the need, so the file that names it is named
        who = f"{named_in} names it: delete that file too"
    return f"the {gone} extra is deleted ({EXTRAS / gone} is gone), but {who}, or restore it (docs/fork.md)"
