"""Every entry's command line is checked before Hydra runs it, so that an override that cannot
compose is one line and exit 2."""

import difflib
import functools
import importlib.metadata
import logging
import re
import sys
from pathlib import Path
from typing import Any, Callable

import hydra
import torch.distributed as dist
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, ValidationError

from cifar_amp import config, seams
from cifar_amp.data import augment
from cifar_amp.errors import fail, missing_package, pip_commands, reported

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
JOB_RUNNER = "job_runner"  # the key, under hydra.callbacks, of a seams.JobRunner that runs jobs


def main(task: Callable[[DictConfig], Any], name: str, schema=None, entry: str | None = None):
    """Check the command line, then run `task` under Hydra with configs/<name>.yaml and the
    schema `schema`; messages name the command `entry`, by default `<name>.py`."""
    with reported():  # so that an extra deleted while another needs it is one line
        config.register(CONFIGS, {name: schema} if schema else None)
    check_overrides(sys.argv[1:], CONFIGS, name, entry)
    hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name=name)(job(task))()


def job(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """One Hydra job: a UserError is one line, exit 2; `hydra.callbacks.job_runner` may run it."""

    @functools.wraps(task)
    def run(cfg: DictConfig):
        # Lightning set up a stderr handler of its own before Hydra did; Hydra's is the run's log.
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
        node = HydraConfig.get().callbacks.get(JOB_RUNNER) if HydraConfig.initialized() else None
        runner = node and hydra.utils.get_class(node._target_)
        if runner and not issubclass(runner, seams.JobRunner):
            fail(f"hydra.callbacks.{JOB_RUNNER}: {node._target_} is not a seams.JobRunner")
        try:
            if runner:
                return runner.run_job(task, cfg)
            with reported():
                return task(cfg)
        finally:
            end_process_group()

    return run


def end_process_group() -> None:
    """A rank exiting with its process group alive can die of SIGABRT (pytorch/pytorch#179291)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_overrides(argv: list[str], config_dir: Path, config_name: str, entry=None) -> None:
    """Exit 2 with one line for an override that cannot compose; each swept value composed once."""
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        values = [v for arg, o in zip(overrides, parsed, strict=True) if (v := _values(arg, o))]
    except Exception:  # Hydra reports an override it cannot parse, except a value's `=`, itself
        for key, _, value in (a.partition("=") for a in overrides if not _parses(a)):
            if "=" in value:  # as in a Lightning checkpoint's name, epoch=0-step=7.ckpt
                fail(
                    f"{key}={value}: Hydra reads the `=` in the value as a second key; quote "
                    f"the value, with the shell's quotes around it: \"{key}='{value}'\""
                )
        return
    first = [v[0] for v in values]
    jobs = [first] + [[*first[:i], x, *first[i + 1 :]] for i, v in enumerate(values) for x in v[1:]]
    with hydra.initialize_config_dir(str(config_dir), version_base="1.3"):
        if config_name != "train":
            _check_entry_keys(overrides, parsed, config_dir, config_name, entry)
        for job_argv in jobs:
            _check_job(job_argv, config_dir, config_name, multirun=len(overrides) < len(argv))


def _parses(arg: str) -> bool:
    try:
        return bool(OverridesParser.create().parse_overrides([arg]))
    except Exception:
        return False


def _values(arg: str, o) -> list[str]:
    try:
        return [f"{arg.partition('=')[0]}={v}" for v in o.sweep_string_iterator()]
    except Exception:  # not a sweep, or one that the sweeper samples (Optuna's interval)
        return [] if o.is_sweep_override() else [arg]


def _check_entry_keys(argv: list[str], parsed: list, config_dir: Path, name: str, entry=None):
    """A train.py override given to another entry (Hydra would ignore it): where it comes from."""
    ours, entry = set(hydra.compose(name)), entry or f"{name}.py"
    groups = {p.name for p in config_dir.iterdir() if p.is_dir()} - {"hydra"}
    for arg, o in zip(argv, parsed, strict=True):
        top = re.split(r"[./@]", o.key_or_group)[0]  # model.x, module/optimizer, model@x
        if top not in ours and top in set(hydra.compose("train")) | groups:
            what = f"no {top} (a train.py setting)"
            if took := config.FROM_CHECKPOINT.get(top):
                what = f"{took} from the checkpoint (ckpt_path), not from {top}"
            fail(f"{arg}: {entry} takes {what}; its keys: {', '.join(sorted(ours))}")


def _check_job(argv: list[str], config_dir: Path, config_name: str, multirun: bool) -> None:
    try:
        cfg = hydra.compose(config_name, argv, return_hydra_config=True)
    except hydra.MissingConfigException as e:  # an option of a group that does not exist
        group, _, choice = str(e.missing_cfg_file).rpartition("/")
        if choice in (chosen := _override_of(argv, group) or ""):
            valid = e.options or sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
            fail(f"{group}={choice} is not an option; valid: {', '.join(valid)}")
        if chosen and group.startswith("hydra/"):  # the option builds on a Hydra plugin's config
            have = {d.name.lower().replace("_", "-") for d in importlib.metadata.distributions()}
            absent = [
                f"{n}, which is not installed here: {how}" for n, how in pip_commands().items()
            ]
            why = [a for a in absent if a.startswith("hydra-") and a.split(",")[0] not in have]
            why = "; ".join(why) or "no installed package provides it"
            fail(f"{chosen} needs {group}/{choice}, a config of a Hydra plugin: {why}")
        return  # Hydra reports, in its own words, a missing config that the user did not choose
    except hydra.errors.ConfigCompositionException as e:
        # Raised inside a config file (a recipe's), the error is the context, not the cause.
        cause, source = e.__cause__ or e.__context__, re.match(r"In '([^']+)/([^'/]+)'", str(e))
        key = getattr(cause, "full_key", None)
        bad = next((a for a in argv if a.lstrip("+~").startswith((f"{key}=", f"{key}."))), None)
        if key and isinstance(cause, ValidationError):
            fail(f"{bad or key}: {str(cause.msg).splitlines()[0]}")
        if not (key and isinstance(cause, (KeyError, AttributeError))):  # omegaconf's, by full_key
            return
        parent, _, name = key.rpartition(".")
        valid = sorted(map(str, cause.parent_node or {}))  # the keys where it was looked for
        keys = ", ".join(valid)
        if source and not bad:  # a key a recipe sets, as experiment=cpu_quick sets model.widths
            option, taker = "=".join(source.groups()), _override_of(argv, parent) or parent
            fail(f"{option} sets {key}, which {taker} does not take; its keys: {keys}")
        if not valid and parent:  # a null node, as module/scheduler=none leaves it
            group = parent.replace(".", "/")
            options = GlobalHydra.instance().config_loader().get_group_options(group)
            choose = f"; choose one with {group}=: {', '.join(options)}" if options else ""
            fail(f"{key}: {parent} is null, which takes no keys{choose}")
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean {key.removesuffix(name)}{close[0]}? " if close else ""
        node = cause.parent_node if isinstance(cause.parent_node, DictConfig) else {}
        if key == "data.augment" and "_target_" in node:  # mixing options, where none are
            fail(augment.cannot_mix(node["_target_"]))
        of = f" ({node['_target_']})" if "_target_" in node else ""
        fail(f"{key} is not a config key; {hint}valid keys of {parent or 'the config'}{of}: {keys}")
    except Exception:  # Hydra reports anything else (syntax, ...) in its own words
        for arg in (a for a in argv if a.endswith("=null")):  # Hydra's ValueError for a group
            options = (
                GlobalHydra.instance()
                .config_loader()
                .get_group_options(arg.partition("=")[0].lstrip("+"))
            )
            if options:
                fail(f"{arg}: a config group takes one of its options; valid: {', '.join(options)}")
        return
    for group in ("sweeper", "launcher") if multirun or cfg.hydra.mode == RunMode.MULTIRUN else ():
        try:  # its package may be missing, which Hydra reports with a traceback once it starts
            importlib.import_module(cfg.hydra[group]._target_.rpartition(".")[0])
        except Exception as e:  # a missing package is ours to name; anything else, Hydra's
            if missing := missing_package(e):
                fail(f"{_override_of(argv, f'hydra/{group}') or f'hydra/{group}'} needs {missing}")


def _override_of(argv: list[str], key: str) -> str | None:  # a key, or a group: hydra/launcher
    return next((a for a in argv if a.lstrip("+~").partition("=")[0] == key), None)
