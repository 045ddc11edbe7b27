"""Typed config schemas. Each field is documented and validated here, where it is defined.

The schemas are registered in Hydra's ConfigStore as ``train_schema`` / ``eval_schema`` and
sit first in ``configs/train.yaml``'s defaults, so a typo (``trainer.max_epoch=3``) or a wrong
type (``trainer.max_epochs=abc``) fails at composition, and :func:`validate` checks ranges
before anything is built. YAML files only hold what differs from the defaults below.
"""

from __future__ import annotations

import inspect
import math
import secrets
import typing
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from cifar_amp import metrics
from cifar_amp.errors import UserError

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")
DATASETS = ("cifar10", "cifar100")
RUN_ID = secrets.token_hex(3)  # one per process; `${run_id:}` in run dir names
TTA_MODES = ("none", "flip", "flip_shift")  # see tta.py


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise UserError(f"invalid config value for {key}: {msg}")


@dataclass
class AugmentConfig:
    """Batch-wise augmentation applied on the training device (see data/augment.py)."""

    flip: bool = True  # random horizontal flip, per image
    alternate_flip: bool = False  # flip each image in alternate epochs instead of at random
    translate: int = 4  # random shift of up to N pixels (reflect-padded crop); 0 = off
    cutout: int = 0  # side of a random zeroed square per image; 0 = off

    def validate(self, key: str) -> None:
        _check(0 <= self.translate <= 16, f"{key}.translate", f"{self.translate} not in [0, 16]")
        _check(0 <= self.cutout <= 32, f"{key}.cutout", f"{self.cutout} not in [0, 32]")


@dataclass
class DataConfig:
    dataset: str = "cifar10"  # one of DATASETS
    # Folder holding `cifar-10-batches-py/` (or the folder itself). Downloaded here if
    # missing and `download` is true; a folder you supply is read without checksums.
    data_dir: str = "data"
    download: bool = True
    batch_size: int = 512  # per device
    eval_batch_size: int = 1024  # per device, for validation and test
    val_split: float = 0.1  # fraction of the training set held out for validation, in [0, 1)
    # The training images live on the training device; this keeps a second copy in the
    # compute dtype out of the loop. Nothing to configure beyond augmentation.
    augment: AugmentConfig = field(default_factory=AugmentConfig)

    def validate(self, key: str = "data") -> None:
        _check(self.dataset in DATASETS, f"{key}.dataset", f"{self.dataset!r}; valid: {DATASETS}")
        _check(self.batch_size >= 1, f"{key}.batch_size", f"{self.batch_size}; must be >= 1")
        _check(self.eval_batch_size >= 1, f"{key}.eval_batch_size", "must be >= 1")
        _check(0.0 <= self.val_split < 1.0, f"{key}.val_split", f"{self.val_split} not in [0, 1)")
        self.augment.validate(f"{key}.augment")


@dataclass
class ScalerConfig:
    """torch.amp.GradScaler arguments; used by `16-mixed` only. Defaults are torch's."""

    enabled: bool = True
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def validate(self, key: str) -> None:
        _check(self.init_scale > 0, f"{key}.init_scale", "must be > 0")
        _check(self.growth_factor > 1, f"{key}.growth_factor", "must be > 1")
        _check(0 < self.backoff_factor < 1, f"{key}.backoff_factor", "must be in (0, 1)")
        _check(self.growth_interval >= 1, f"{key}.growth_interval", "must be >= 1")


@dataclass
class PrecisionConfig:
    # Lightning precision name. `16-mixed` means float16 autocast + GradScaler on every
    # device, CPU included (Lightning alone would quietly use bfloat16 on CPU).
    name: str = "32-true"
    scaler: ScalerConfig = field(default_factory=ScalerConfig)

    def validate(self, key: str = "precision") -> None:
        _check(self.name in PRECISIONS, f"{key}.name", f"{self.name!r}; valid: {PRECISIONS}")
        self.scaler.validate(f"{key}.scaler")


@dataclass
class ModuleConfig:
    """The LightningModule around the network (see module.py)."""

    # Hydra partials: the module adds `params` / `optimizer` and, for OneCycleLR,
    # `total_steps`. Set `scheduler` to null for a constant learning rate.
    optimizer: Any = field(
        default_factory=lambda: {
            "_target_": "torch.optim.SGD",
            "_partial_": True,
            "lr": 0.2,
            "momentum": 0.9,
            "nesterov": True,
            "weight_decay": 5e-4,
        }
    )
    scheduler: Any = field(
        default_factory=lambda: {
            "_target_": "torch.optim.lr_scheduler.OneCycleLR",
            "_partial_": True,
            "max_lr": "${module.optimizer.lr}",
            "pct_start": 0.25,
            "anneal_strategy": "linear",
        }
    )
    label_smoothing: float = 0.0
    channels_last: bool = False  # NHWC weights and inputs; faster convs under AMP on GPU
    compile: bool = False  # torch.compile the network
    # Test-time augmentation in test (and in validation if `tta_val`): none | flip |
    # flip_shift (flips plus +-`tta_shift`-pixel shifts); views and weights in tta.py.
    tta: str = "none"
    tta_shift: int = 1
    tta_val: bool = False

    def validate(self, key: str = "module") -> None:
        _check(0.0 <= self.label_smoothing < 1.0, f"{key}.label_smoothing", "must be in [0, 1)")
        _check(self.tta in TTA_MODES, f"{key}.tta", f"{self.tta!r}; valid: {TTA_MODES}")
        _check(1 <= self.tta_shift <= 8, f"{key}.tta_shift", f"{self.tta_shift} not in [1, 8]")
        lr = self.optimizer.get("lr") if isinstance(self.optimizer, dict) else None
        if isinstance(lr, (int, float)):
            _check(lr > 0 and math.isfinite(lr), f"{key}.optimizer.lr", f"{lr}; must be > 0")


@dataclass
class TrainerConfig:
    """lightning.Trainer arguments that the template supports. Add a field here to pass
    another one; anything not listed is a typo and fails at composition."""

    accelerator: str = "auto"
    devices: Any = "auto"
    strategy: str = "auto"
    num_nodes: int = 1
    max_epochs: int = 10
    max_steps: int = -1
    gradient_clip_val: Optional[float] = None  # acts on unscaled gradients under 16-mixed
    gradient_clip_algorithm: str = "norm"  # norm | value
    accumulate_grad_batches: int = 1
    # cudnn autotuning; null = on unless `deterministic` (no effect on CPU)
    benchmark: Optional[bool] = None
    deterministic: bool = False
    sync_batchnorm: bool = False
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    limit_test_batches: Any = None
    val_check_interval: Any = None
    check_val_every_n_epoch: int = 1
    num_sanity_val_steps: int = 0
    log_every_n_steps: int = 50
    fast_dev_run: Any = False
    enable_progress_bar: bool = True
    enable_model_summary: bool = True

    def validate(self, key: str = "trainer") -> None:
        clip = self.gradient_clip_val
        _check(clip is None or clip >= 0, f"{key}.gradient_clip_val", f"{clip}; must be >= 0")
        _check(
            self.gradient_clip_algorithm in ("norm", "value"),
            f"{key}.gradient_clip_algorithm",
            f"{self.gradient_clip_algorithm!r}; valid: ('norm', 'value')",
        )
        _check(self.max_epochs >= -1, f"{key}.max_epochs", "must be >= -1")
        _check(self.num_nodes >= 1, f"{key}.num_nodes", "must be >= 1")
        _check(self.accumulate_grad_batches >= 1, f"{key}.accumulate_grad_batches", "must be >= 1")

    def kwargs(self) -> dict[str, Any]:
        """Arguments for lightning.Trainer; unset (None) limits keep Lightning's defaults."""
        out = {k: v for k, v in vars(self).items() if v is not None or k == "gradient_clip_val"}
        out["benchmark"] = (not self.deterministic) if self.benchmark is None else self.benchmark
        return out


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: Any = None  # a network: `_target_` + its arguments (configs/model/)
    module: ModuleConfig = field(default_factory=ModuleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    callbacks: Any = field(default_factory=dict)  # name -> Lightning callback (`_target_`)
    logger: Any = field(default_factory=dict)  # name -> Lightning logger (`_target_`)
    run_dir: str = "${hydra:runtime.output_dir}"  # checkpoints, logs, metrics.json
    seed: int = 42  # seeds the split, augmentation and initialisation
    ckpt_path: Optional[str] = None  # resume from this checkpoint
    test: bool = True  # test the best checkpoint after fit
    # Returned by train.py for sweepers (Optuna maximises it); a key of metrics.json.
    optimized_metric: str = metrics.VAL_ACC_BEST

    def validate(self) -> None:
        self.data.validate()
        self.module.validate()
        self.precision.validate()
        self.trainer.validate()
        _check(self.seed >= 0, "seed", f"{self.seed}; must be >= 0")


@dataclass
class EvalConfig:
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: Any = field(default_factory=dict)
    run_dir: str = "${hydra:runtime.output_dir}"
    seed: int = 42
    ckpt_path: Optional[str] = None  # required: the checkpoint to test

    def validate(self) -> None:
        self.data.validate()
        self.precision.validate()
        self.trainer.validate()
        _check(
            bool(self.ckpt_path),
            "ckpt_path",
            "required, e.g. ckpt_path=<run>/checkpoints/last.ckpt",
        )


def to_object(cfg: DictConfig):
    """Resolve a composed config into its schema dataclass and validate ranges."""
    obj = OmegaConf.to_object(cfg)
    if isinstance(obj, TrainConfig):
        # A plain dict, not the generated schema class: it is saved in checkpoints.
        obj.model = OmegaConf.to_container(cfg.model, resolve=True)
    obj.validate()
    return obj


def model_schema(cls: type) -> type:
    """A schema for a network class, made from its constructor: `_target_` plus every
    keyword argument but `num_classes` (the data decides it), with the code's defaults.
    So `model.<arg>=...` works on the command line, typos and wrong types fail at
    composition, and a model's YAML only holds what differs from its code."""
    hints = typing.get_type_hints(cls.__init__)
    fields: list[tuple] = [("_target_", str, field(default=f"{cls.__module__}.{cls.__name__}"))]
    for name, p in inspect.signature(cls).parameters.items():
        if name == "num_classes" or p.default is inspect.Parameter.empty:
            continue
        typ = hints.get(name, Any)
        typ = typ if typ in (int, float, bool, str) else Any
        default = list(p.default) if isinstance(p.default, tuple) else p.default
        fields.append((name, typ, field(default_factory=lambda d=default: d)))
    return make_dataclass(f"{cls.__name__}Config", fields)


def sqlite_url(path: str) -> str:
    """``${sqlite:<file>}`` -> a SQLAlchemy URL, creating the file's folder (SQLite does not),
    so that the Optuna study of ``hparams_search`` can live under ``logs/`` on a fresh clone."""
    db = Path(path).expanduser().resolve()
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def register() -> None:
    from cifar_amp import models  # each class in models.__all__ gets model_schema/<Name>

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)
    for name in models.__all__:
        cs.store(group="model_schema", name=name, node=model_schema(getattr(models, name)))
    if not OmegaConf.has_resolver("metric"):
        OmegaConf.register_new_resolver("metric", metrics.resolve)
    if not OmegaConf.has_resolver("sqlite"):
        OmegaConf.register_new_resolver("sqlite", sqlite_url)
    if not OmegaConf.has_resolver(
        "run_id"
    ):  # configs/hydra: runs started in the same second differ
        OmegaConf.register_new_resolver("run_id", lambda: RUN_ID)


register()
