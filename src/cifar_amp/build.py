"""Builds each part of a run from its config node, an error as one line naming the key, and
passes each part what another decided (num_classes, channels_last, the precision plugin)."""

import inspect
import logging
from collections.abc import Mapping

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelSummary, ProgressBar
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from cifar_amp import config, messages, seams
from cifar_amp.checkpoints import MODULE_CLASS, Checkpoint
from cifar_amp.data import augment
from cifar_amp.errors import InvalidArgument, NestedBuildError, UserError, missing_package
from cifar_amp.lean_module import LeanModule

log = logging.getLogger(__name__)


def build(node, key: str, recursive: bool = True, **kwargs):
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
        if missing := missing_package(cause):  # a package an option needs that is not installed
            raise UserError(f"{key} needs {missing}") from e
        if isinstance(cause, MissingMandatoryValue):  # a required constructor argument
            raise UserError(f"{cause.full_key} is required: set {cause.full_key}=...") from e
        if isinstance(cause, InvalidArgument):
            raise UserError(f"invalid config value for {key}.{cause}") from e
        raise UserError(f"cannot build {key}: {type(cause).__name__}: {cause}") from e


def precision(cfg: DictConfig, started_from=None) -> seams.PrecisionMode:
    """`cfg.precision`; auto (seams.FollowsCheckpoint) takes the mode `started_from` records."""
    prec = build(cfg.precision, "precision")
    recorded = started_from and started_from.settings.get("precision")
    prec.settle(cfg.trainer.get("accelerator"), resumes=recorded)
    if started_from and isinstance(prec, seams.FollowsCheckpoint):
        prec.adopt(recorded)
    return prec


def callbacks(cfg: DictConfig) -> list[L.Callback]:
    out = [build(c, f"callbacks.{k}") for k, c in (cfg.get("callbacks") or {}).items() if c]
    if not cfg.get("logger"):  # LearningRateMonitor refuses to run without a logger
        out = [c for c in out if not isinstance(c, LearningRateMonitor)]
    if cfg.trainer.get("enable_progress_bar") is False:  # Lightning refuses a bar then
        out = [c for c in out if not isinstance(c, ProgressBar)]
    if cfg.trainer.get("enable_model_summary") is False:
        out = [c for c in out if not isinstance(c, ModelSummary)]
    return out


def loggers(cfg: DictConfig, resumed: dict | None = None) -> dict:
    """The `logger` group by key; a tracker (seams.ContinuesRun) continues `resumed`'s run."""
    out = {}
    for key, node in ((k, n) for k, n in (cfg.get("logger") or {}).items() if n):
        kwargs = {}
        try:  # build() below names the key of a _target_ that does not import
            tracker = get_class(node._target_) if resumed else None
        except Exception:
            tracker = None
        if tracker and issubclass(tracker, seams.ContinuesRun):
            kwargs = tracker.resuming(resumed, key)
        out[key] = build(node, f"logger.{key}", **kwargs)
    return out


def trainer(
    cfg: DictConfig, prec: seams.PrecisionMode | None = None, callbacks=(), loggers=(), **overrides
):
    """The Trainer of `cfg.trainer` (`overrides` win), which the precision then sets up for the
    device it chose (TF32, channels_last)."""
    messages.quiet()
    t, prec = cfg.trainer, prec or precision(cfg)
    if "strategy" not in overrides and (built := strategy(t.strategy)) is not None:
        overrides["strategy"] = built
    check_fused_optimizer(cfg, prec, overrides.get("strategy", t.strategy))
    if OmegaConf.select(cfg, "module.compile"):  # test reuses validation's graph (no_grad),
        overrides.setdefault("inference_mode", False)  # not one more for inference tensors
    if t.get("benchmark") is None:  # cudnn autotuning is on unless the run must be deterministic
        overrides.setdefault("benchmark", not t.get("deterministic"))
    overrides |= precision_args(t, prec, overrides) | {"logger": list(loggers) or False}
    made = build(t, "trainer", callbacks=list(callbacks), default_root_dir=cfg.run_dir, **overrides)
    prec.setup(made)
    return made


def strategy(node):
    """`trainer.strategy` built where Lightning cannot take the config as it is: a mapping, or
    a name whose ranks would restart per stage (started once, as ddp's, instead); else None."""
    if (start := per_stage_ranks(node)) and HydraConfig.initialized():
        if isinstance(node, str):  # a registered name stands for its class and arguments
            entry = StrategyRegistry[node]
            node = dict(entry["init_params"], _target_=entry["strategy"])
        log.info(f"Ranks started once, by re-running this command as ddp's, not by {start}")
        return build(node, "trainer.strategy", start_method="popen")
    return build(node, "trainer.strategy") if isinstance(node, Mapping) else None


def check_fused_optimizer(cfg: DictConfig, prec: seams.PrecisionMode, strategy) -> None:
    """Lightning's sharded plugins do not clip a fused optimizer's gradients (ours do), and
    FSDP's flat parameters cannot be stepped by one."""
    clip = cfg.trainer.get("gradient_clip_val")
    if clip and OmegaConf.select(cfg, "module.optimizer.fused") and prec.autocasts:
        if isinstance(strategy, seams.StrategyWithFloat16Plugin):
            raise UserError(
                f"trainer.gradient_clip_val={clip} with module.optimizer.fused=true under "
                f"precision={prec.name} with {type(strategy).__name__}: Lightning does not clip a "
                "fused optimizer's gradients there; add trainer.gradient_clip_val=null (the "
                "default trainer clips) or module.optimizer.fused=false"
            )
    if OmegaConf.select(cfg, "module.optimizer.fused") and isinstance(
        strategy, seams.StrategyWithoutFusedOptimizers
    ):
        raise UserError(
            f"module.optimizer.fused=true with {type(strategy).__name__}: torch's fused optimizer "
            "refuses its flattened parameters at the first step (check_fast_path_restrictions); "
            "add module.optimizer.fused=false"
        )


def precision_args(t: DictConfig, prec: seams.PrecisionMode, overrides: dict) -> dict:
    """The precision's Trainer arguments; a plugin of its joins the configured ones (after them)."""
    accelerator = overrides.get("accelerator", t.get("accelerator"))
    args = prec.trainer_args(accelerator, overrides.get("strategy", t.strategy))
    if "plugins" in args:
        configured = build(t.plugins, "trainer.plugins") if t.get("plugins") else []
        args["plugins"][:0] = configured if isinstance(configured, list) else [configured]
    return args


def per_stage_ranks(strategy) -> str | None:
    """`trainer.strategy`'s start method if its ranks restart for fit and test (losing the log)."""
    if isinstance(strategy, str):
        strategy = StrategyRegistry[strategy]["init_params"] if strategy in StrategyRegistry else {}
    start = strategy.get("start_method") if isinstance(strategy, Mapping) else None
    return start if start in ("spawn", "fork", "forkserver") else None


def datamodule(cfg: DictConfig, channels_last: bool = False) -> L.LightningDataModule:
    takes = inspect.signature(get_class(cfg.data._target_)).parameters
    if "augment" in cfg.data and "augment" not in takes:  # `+data.augment...`: cli.py names
        raise UserError(augment.cannot_mix(cfg.data._target_))  # the key otherwise
    # A user's DataModule need not know about memory layouts; ours lays batches out once.
    if "channels_last" in takes:
        return build(cfg.data, "data", channels_last=channels_last)
    if channels_last:
        log.warning(
            f"Layout: the network is channels_last, but {cfg.data._target_.rsplit('.', 1)[-1]} "
            "takes no channels_last argument: its batches keep the layout it gives them"
        )
    return build(cfg.data, "data")


def module(cfg: DictConfig, num_classes: int, channels_last=False):
    # Not recursive: the module builds `net` (keeping its config), configure_optimizers the rest.
    net = OmegaConf.to_container(cfg.model, resolve=True)
    args = dict(num_classes=num_classes, channels_last=channels_last)
    # A LeanModule ranks its best validation value by the run's monitor; a module of another
    # kind logs what it logs, and the checkpoint callbacks read the monitor from the config.
    try:
        cls = get_class(cfg.module._target_)
        lean = issubclass(cls, LeanModule) and "monitor" in config.arguments(cls)
    except Exception:  # build() below names a _target_ that does not import
        lean = False
    if lean:
        args |= dict(monitor=cfg.monitor.metric, monitor_mode=cfg.monitor.mode)
    return build(cfg.module, "module", recursive=False, net=net, **args)


def module_class(ckpt: Checkpoint) -> type[L.LightningModule]:
    """The LightningModule class that trained `ckpt`, looked up by the name it records (checked
    to be a LightningModule before anything of it is called); one line if it is not one here.
    Every class name `ckpt` holds is checked first: each entry rebuilding from it comes here."""
    ckpt.check_class_names()
    path = ckpt.settings.get(MODULE_CLASS)
    try:
        cls = config.find_class(path)
    except (LookupError, ImportError) as e:
        raise UserError(
            f"{ckpt.where} was trained by the module {path}, which does not import here ({e}): "
            "run where its code is importable (on PYTHONPATH, or installed)"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, L.LightningModule)):
        raise UserError(f"{ckpt.where} names {path} as its module, which is not a LightningModule")
    return cls


def module_from_checkpoint(ckpt: Checkpoint, **overrides) -> L.LightningModule:
    """`ckpt`'s LightningModule, of the class that trained it, built with its own arguments (the
    `overrides` it takes win), in eval mode, weights loaded (EMA's: averaged)."""
    cls = module_class(ckpt)
    takes = config.arguments(cls)
    args = {k: v for k, v in ckpt.hparams.items() if k in takes}
    args |= {k: v for k, v in overrides.items() if k in takes}
    try:
        module = cls(**args)
        module.load_state_dict(ckpt.data["state_dict"])
    except InvalidArgument as e:
        raise UserError(f"invalid config value for {e}") from e
    except Exception as e:
        raise UserError(f"{ckpt.where}: cannot load ({type(e).__name__}: {e})") from e
    return module.eval()
