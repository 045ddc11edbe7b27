"""Builders: turn the composed config's `_target_` nodes into objects, with `instantiate`.

Each error a constructor raises is reported by the config key it came from, on one line.
Values that one part decides for another are passed here and nowhere else: the number of
classes (data -> model), the memory layout (the Trainer's device and the precision -> module,
data), the run dir, the tracker runs a resume continues (checkpoint -> loggers).
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, instantiate
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.strategies import DDPStrategy, Strategy, StrategyRegistry
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from cifar_amp.errors import InvalidArgument, NestedBuildError, UserError, missing_package
from cifar_amp.module import ImageClassifier
from cifar_amp.precision import Precision

log = logging.getLogger(__name__)


def build(node: Any, key: str, recursive: bool = True, **kwargs) -> Any:
    """`instantiate(node, **kwargs)`; any error becomes a one-line UserError naming `key`."""
    try:
        return instantiate(node, _convert_="all", _recursive_=recursive, **kwargs)
    except Exception as e:
        cause = e
        while cause.__cause__ is not None and not isinstance(cause, (InvalidArgument, UserError)):
            key = cause.key if isinstance(cause, NestedBuildError) else key
            cause = cause.__cause__
        if isinstance(cause, UserError):
            raise cause from e
        if missing := missing_package(cause):  # an extra's package, e.g. logger=mlflow's
            raise UserError(f"{key} needs {missing}") from e
        if isinstance(cause, MissingMandatoryValue):  # a required constructor argument
            raise UserError(f"{cause.full_key} is required: set {cause.full_key}=...") from e
        if isinstance(cause, InvalidArgument):
            raise UserError(f"invalid config value for {key}.{cause}") from e
        raise UserError(f"cannot build {key}: {type(cause).__name__}: {cause}") from e


def precision(cfg: DictConfig) -> Precision:
    return build(cfg.precision, "precision")


def callbacks(cfg: DictConfig) -> list[L.Callback]:
    out = [build(c, f"callbacks.{k}") for k, c in (cfg.get("callbacks") or {}).items() if c]
    if not cfg.get("logger"):  # LearningRateMonitor refuses to run without a logger
        out = [c for c in out if not isinstance(c, LearningRateMonitor)]
    return out


def loggers(cfg: DictConfig, versions: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `logger` group, by config key. A logger whose constructor takes `version` gets the
    one `versions` has for its key: a resume continues the tracked run."""
    out = {}
    for key, node in (cfg.get("logger") or {}).items():
        if not node:
            continue
        kwargs = {}
        if (
            key in (versions or {})
            and "version" in inspect.signature(get_class(node._target_)).parameters
        ):
            kwargs["version"] = versions[key]
            log.info("Resuming: logger.%s continues run %s", key, versions[key])
        out[key] = build(node, f"logger.{key}", **kwargs)
    return out


def trainer(
    cfg: DictConfig, prec: Precision | None = None, callbacks=(), loggers=(), **overrides
) -> L.Trainer:
    """The Trainer of `cfg.trainer` with the callbacks, loggers and the run dir as root, and the
    precision set up for the device it chose; `overrides` win over the config."""
    t, prec = cfg.trainer, prec or precision(cfg)
    clip = t.get("gradient_clip_val")
    if clip is not None and clip < 0:
        raise UserError(f"invalid config value for trainer.gradient_clip_val: {clip}; must be >= 0")
    if t.get("accumulate_grad_batches", 1) < 1:
        raise UserError("invalid config value for trainer.accumulate_grad_batches: must be >= 1")
    if clip and OmegaConf.select(cfg, "module.optimizer.fused") and prec.autocasts:
        raise UserError(
            f"trainer.gradient_clip_val={clip} with module.optimizer.fused=true under "
            f"precision={prec.name}: the fused optimizer unscales the gradients inside its step, "
            "so they cannot be clipped before it; drop one of the two (32-true clips with it)"
        )
    if isinstance(t.accelerator, str) and not _visible(t.accelerator):
        raise UserError(
            f"{_chosen_by() or 'this run'} needs a {t.accelerator} device (trainer.accelerator="
            f"{t.accelerator}) and none is visible here; to run it on this machine's CPU add "
            "trainer=cpu (or trainer=ddp_cpu: 2 processes)"
        )
    if per_stage_ranks(t.strategy) and HydraConfig.initialized():
        overrides.setdefault("strategy", _ranks_once(t.strategy))
        log.info(
            "trainer.strategy=%s: the ranks are started once for all stages, by re-running this "
            "command (start_method=popen, as for ddp); ranks started by %s would be new processes "
            "for each of fit and test, handing back only the weights and the last metrics",
            t.strategy if isinstance(t.strategy, str) else t.strategy._target_,
            per_stage_ranks(t.strategy),
        )
    made = build(
        t,
        "trainer",
        precision=prec.trainer_precision,
        # cudnn autotuning: on unless the run must be deterministic (null in the config)
        benchmark=(not t.get("deterministic")) if t.get("benchmark") is None else t.benchmark,
        callbacks=list(callbacks),
        logger=list(loggers) or False,
        default_root_dir=cfg.run_dir,
        **overrides,
    )
    cores = os.cpu_count() or 1
    if made.strategy.root_device.type == "cpu":
        if made.num_devices > cores:
            raise UserError(
                f"trainer.devices={t.devices}: only {cores} CPU core(s) here; valid: 1..{cores}, -1 (all) or auto"
            )
        if isinstance(made.strategy, DDPStrategy) and made.world_size == 1:
            raise UserError(
                f"trainer.strategy={t.strategy} with trainer.devices={t.devices} on CPU is a single "
                "process, so there is nothing to distribute; use trainer=ddp_cpu (2 processes), "
                "trainer.devices=N, or trainer.strategy=auto"
            )
    asked = _asked_devices(t.devices)
    if asked and asked > 1 and made.num_devices == 1:  # Lightning would use one, silently
        raise UserError(
            f"trainer.devices={t.devices} with trainer.strategy={t.strategy}: that strategy runs "
            "on one device; use trainer.strategy=ddp (or auto) for several, or trainer.devices=1"
        )
    prec.setup(made)
    skip_unused_hooks(made.callbacks, L.Callback)
    return made


# The hooks Lightning calls once per training step, and once per evaluation batch.
TRAINING_STEP_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)
PER_BATCH_HOOKS = TRAINING_STEP_HOOKS + tuple(
    f"on_{stage}_batch_{when}"
    for stage in ("validation", "test", "predict")
    for when in ("start", "end")
)


def skip_unused_hooks(objects, base: type, hooks: tuple[str, ...] = PER_BATCH_HOOKS) -> None:
    """Hide from Lightning the per-batch hooks each of `objects` (callbacks, or a
    LightningModule) leaves as `base`'s no-ops.

    Why: Lightning calls every per-batch hook of every callback and of the module at every
    step, overridden or not, each inside a profiler context named by a string it formats, and
    sets the module's `_current_fx_name` around it (about 1.5 us a call on the dev box's CPU;
    6 per training step x 11 callbacks in the speed recipe), and it skips a hook that is not
    callable. A hook that an object's class defines is kept."""
    for obj in objects:
        for hook in hooks:
            if getattr(type(obj), hook, None) is getattr(base, hook):
                setattr(obj, hook, None)


def _asked_devices(devices: Any) -> int | None:
    """How many devices `trainer.devices` names (2, "2", [0, 1], "0,1"); None for auto, -1."""
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text) if text.isdigit() else None


def _visible(accelerator: str) -> bool:
    """Whether Lightning finds a device for `trainer.accelerator` here (`gpu`: CUDA or MPS;
    a name Lightning does not know is left to it)."""
    names = ("cuda", "mps") if accelerator == "gpu" else (accelerator,)
    known = [AcceleratorRegistry[n]["accelerator"] for n in names if n in AcceleratorRegistry]
    return not known or any(a.is_available() for a in known)


def _chosen_by() -> str:
    """The option that set the device, so that a user who did not know it can tell: the recipe
    (`experiment=speedrun_gpu`), else the trainer option; empty outside a command."""
    if not HydraConfig.initialized():
        return ""
    choices = HydraConfig.get().runtime.choices
    picked = [(g, choices.get(g)) for g in ("experiment", "trainer")]
    return next((f"{g}={c}" for g, c in picked if c not in (None, "default")), "")


# Lightning's start methods that make the ranks worker processes of this one, started anew for
# each of trainer.fit and trainer.test (ddp_spawn, ddp_fork, ddp_notebook and their
# *_find_unused_parameters_* forms). Such a stage hands back to this process only the weights,
# the best checkpoint's path and the last metrics: what a run keeps from fit to test and
# reports after them (the CSV log's columns, the epoch count) would be lost or wrong.
WORKER_START_METHODS = ("spawn", "fork", "forkserver")


def per_stage_ranks(strategy: Any) -> str | None:
    """The start method of `trainer.strategy` if it is one of WORKER_START_METHODS, else None:
    a registered name (`ddp_spawn`) or a `_target_` node with `start_method`."""
    if isinstance(strategy, str):
        entry = StrategyRegistry[strategy] if strategy in StrategyRegistry else {}
        start = entry.get("init_params", {}).get("start_method")
    else:
        start = strategy.get("start_method") if OmegaConf.is_dict(strategy) else None
    return start if start in WORKER_START_METHODS else None


def _ranks_once(strategy: Any) -> Strategy:
    """The same strategy with its ranks started once by re-running the command (popen), as
    `ddp` starts them; a Hydra command can, since a rank re-runs exactly this job (cli.job)."""
    if isinstance(strategy, str):
        entry = StrategyRegistry[strategy]
        return entry["strategy"](**{**entry["init_params"], "start_method": "popen"})
    return build(strategy, "trainer.strategy", start_method="popen")


def datamodule(cfg: DictConfig, channels_last: bool = False) -> L.LightningDataModule:
    # A user's DataModule need not know about memory layouts; ours lays batches out once.
    if "channels_last" in inspect.signature(get_class(cfg.data._target_)).parameters:
        return build(cfg.data, "data", channels_last=channels_last)
    if channels_last:
        log.warning(
            "Layout: the network is channels_last, but %s takes no channels_last argument: "
            "its batches keep the layout it gives them",
            cfg.data._target_.rsplit(".", 1)[-1],
        )
    return build(cfg.data, "data")


def module(
    cfg: DictConfig, num_classes: int, channels_last: bool = False, data_meta=None
) -> ImageClassifier:
    # Not recursive: `net`, `optimizer` and `scheduler` stay configs. The module builds the
    # network (and keeps its config in checkpoints), configure_optimizers the others.
    net = OmegaConf.to_container(cfg.model, resolve=True)
    kwargs = dict(
        net=net, num_classes=num_classes, channels_last=channels_last, data_meta=data_meta
    )
    made = build(cfg.module, "module", recursive=False, **kwargs)
    # Training steps only: Lightning reads the signatures of the module's evaluation batch hooks.
    skip_unused_hooks([made], L.LightningModule, TRAINING_STEP_HOOKS)
    return made
