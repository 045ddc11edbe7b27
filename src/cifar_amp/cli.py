"""The command line: `train.py`, `eval.py` and the other entries hand over here.

Before Hydra runs, overrides that cannot compose get one line and exit 2 (Hydra's own message
spans several lines and does not say what would be valid), in a `-m` sweep too: each swept
value is composed once. During a sweep, a job whose values are wrong for it fails alone (its
error goes to `<job dir>/error.txt`) and the sweep ends with a summary naming the failed jobs.
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from cifar_amp import config
from cifar_amp.errors import EXIT_CODE, UserError

log = logging.getLogger(__name__)

ERROR_FILE = "error.txt"  # in a failed sweep job's directory
SWEEP_FLAGS = ("-m", "--multirun")


def main(task: Callable[[DictConfig], Any], config_dir: Path, config_name: str) -> None:
    """Check the command line, then run `task` under Hydra with `configs/<config_name>.yaml`."""
    config.register()
    check_overrides(sys.argv[1:], config_dir, config_name)
    hydra.main(version_base="1.3", config_path=str(config_dir.resolve()), config_name=config_name)(
        job(task)
    )()


def job(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """UserError (and Lightning's MisconfigurationException) -> one line; exit 2 in a single
    run, a failed job (NaN to the sweeper, `error.txt` in its dir) in a sweep."""

    @functools.wraps(task)
    def run(cfg: DictConfig):
        try:
            return task(cfg)
        except (UserError, MisconfigurationException) as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            msg = str(e).strip().replace("\n", " ")
            log.error("%s", msg)
            hc = HydraConfig.get() if HydraConfig.initialized() else None
            if hc is None or hc.mode != RunMode.MULTIRUN:
                _fail(msg)
            Path(hc.runtime.output_dir, ERROR_FILE).write_text(msg + "\n")
            return math.nan

    return run


class SweepSummary(Callback):
    """At the end of a sweep: name the failed jobs on stderr and exit 2 if there were any."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        root = Path(config.hydra.sweep.dir)
        failed = sorted(root.glob(f"*/{ERROR_FILE}"), key=lambda p: p.parent.name)
        if not failed:
            return
        jobs = {
            p.parent.parent.name: _read_overrides(p) for p in root.glob("*/.hydra/overrides.yaml")
        }
        varying = set.union(set(), *jobs.values()) - set.intersection(*map(set, jobs.values()))
        lines = []
        for path in failed:
            which = " ".join(o for o in jobs.get(path.parent.name, []) if o in varying)
            lines.append(f"  job {path.parent.name} ({which}): {path.read_text().strip()}")
        print(
            f"error: {len(failed)} job(s) of the sweep in {root} failed:\n" + "\n".join(lines),
            file=sys.stderr,
        )
        sys.exit(EXIT_CODE)


def _read_overrides(path: Path) -> list[str]:
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(EXIT_CODE)


def check_overrides(argv: list[str], config_dir: Path, config_name: str) -> None:
    """Exit 2 with one line for an override that cannot compose, before Hydra runs.

    An unknown group option (with the valid ones), a key that does not exist (with the close
    matches and the valid keys), a value of the wrong type. In a sweep each listed value is
    tried once. Other flags (--cfg, --help, ...) and malformed overrides are left to Hydra.
    """
    _check_group_choices(argv, config_dir)
    flags = [a for a in argv if a.startswith("-")]
    if any(f not in SWEEP_FLAGS for f in flags):
        return
    argv = [a for a in argv if not a.startswith("-")]
    try:
        jobs = _one_job_per_value(argv)
    except Exception:  # unparsable: Hydra reports it in its own words
        return
    for job_argv in jobs:
        _check_job(job_argv, config_dir, config_name)


def _one_job_per_value(argv: list[str]) -> list[list[str]]:
    """Each swept value once: the first job takes every sweep's first value, and each other
    job changes one sweep to one of its other values. Non-enumerable sweeps (Optuna's
    interval) are left out, as the sweeper will choose them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(argv)
    values: list[list[str]] = []
    for arg, o in zip(argv, parsed, strict=True):
        if not o.is_sweep_override():
            values.append([arg])
            continue
        prefix = arg[: len(arg) - len(arg.lstrip("+~"))] + o.get_key_element()
        try:
            values.append([f"{prefix}={v}" for v in o.sweep_string_iterator()])
        except Exception:
            values.append([])
    first = [v[0] for v in values if v]
    jobs = [first]
    for i, v in enumerate(values):
        for other in v[1:]:
            job = [vv[0] for vv in values if vv]
            job[sum(1 for vv in values[:i] if vv)] = other
            jobs.append(job)
    return jobs


def _check_job(argv: list[str], config_dir: Path, config_name: str) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    def composed(overrides):
        with initialize_config_dir(str(config_dir.resolve()), version_base="1.3"):
            return compose(config_name, overrides=overrides)

    try:
        composed(argv)
        return
    except ConfigCompositionException as e:
        cause = e.__cause__
    except Exception:  # anything else (syntax, ...): Hydra reports it in its own words
        return
    key = getattr(cause, "full_key", None)
    if not key:
        return
    bad = next((a for a in argv if a.lstrip("+~").startswith(key)), "")
    if isinstance(cause, ValidationError):
        _fail(f"{bad or key}: {str(cause.msg).splitlines()[0]}")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        parent, _, name = key.rpartition(".")
        try:
            cfg = composed([a for a in argv if a != bad])
            node = OmegaConf.select(cfg, parent) if parent else cfg
            valid = sorted(str(k) for k in node.keys())
        except Exception:
            valid = []
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean {(parent + '.') if parent else ''}{close[0]}? " if close else ""
        where = parent or "the config"
        _fail(f"{key} is not a config key; {hint}valid keys of {where}: {', '.join(valid)}")


def _check_group_choices(argv: list[str], config_dir: Path) -> None:
    """Exit 2 with one line if an override picks a config group option that does not exist.
    Sweeps (`precision=32-true,16-mixed`) are checked item by item."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        group = config_dir / key.lstrip("+")
        if (
            not sep
            or "." in key
            or "/" in key
            or key.startswith("~")
            or not group.is_dir()
            or "(" in value
        ):
            continue
        valid = sorted(p.stem for p in group.glob("*.yaml"))
        # `a,b` is a sweep, `[a,b]` several options of the group merged (callbacks=[default,rich])
        for choice in (c.strip() for c in value.strip("[]").split(",")):
            if choice not in valid and choice != "null":
                _fail(f"{key}={choice} is not an option; valid: {', '.join(valid)}")
