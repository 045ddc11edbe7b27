"""The command line: `train.py`, `eval.py` and the other entries hand over here.

Before Hydra runs, an override that cannot compose gets one line and exit 2 (Hydra's own message
spans several lines and does not say what would be valid), in a `-m` sweep too: each swept
value is composed once. In a sweep, a job whose values are wrong for it fails alone (its error
goes to `<job dir>/error.txt`) and the sweep ends with a summary naming the failed jobs.
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
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

from cifar_amp import config
from cifar_amp.errors import EXIT_CODE, REPORTED, fail, one_line, reported

log = logging.getLogger(__name__)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ERROR_FILE = "error.txt"  # in a failed sweep job's directory


def main(task: Callable[[DictConfig], Any], name: str, schema: type | None = None) -> None:
    """Check the command line, then run `task` under Hydra with `configs/<name>.yaml` (whose
    first default is `<name>_schema`: `schema`, or the core's TrainConfig / EvalConfig)."""
    config.register(CONFIGS, {name: schema} if schema else None)
    check_overrides(sys.argv[1:], CONFIGS, name)
    hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name=name)(job(task))()


def job(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """One Hydra job. A UserError (or Lightning's MisconfigurationException) is one line: exit
    2 in a single run; in a sweep the job fails alone (NaN to the sweeper, `error.txt`).

    Under DDP, Lightning starts ranks > 0 by re-running `sys.argv` with `hydra.run.dir=<the job's
    dir>` (lightning.fabric.strategies.launchers.subprocess_script). In a multirun that argv
    still holds `-m` and the sweep, so each child would run the whole sweep again; and the next
    job would find this one's process group and the LOCAL_RANK Lightning exported (which says
    that someone else starts the ranks). So children re-run exactly this job, and the process
    group and the environment end with it."""

    @functools.wraps(task)
    def run(cfg: DictConfig):
        # Lightning, imported before Hydra set up logging, logs to a stderr handler of its own:
        # hand its records to Hydra's (the console, the run's log file); stderr is for errors.
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
        hc = HydraConfig.get() if HydraConfig.initialized() else None
        if hc is None or hc.mode != RunMode.MULTIRUN:
            with reported():
                return task(cfg)
        env = dict(os.environ)
        sys.argv = [sys.argv[0], *hc.overrides.task, "hydra.mode=RUN"]  # RUN beats a `-m` config
        with read_write(hc.run):
            hc.run.dir = hc.runtime.output_dir
        try:
            return task(cfg)
        except REPORTED as e:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            log.error("%s", one_line(e))
            Path(hc.runtime.output_dir, ERROR_FILE).write_text(one_line(e) + "\n")
            return math.nan
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(env)

    return run


class SweepSummary(Callback):
    """At the end of a sweep: name the failed jobs on stderr and exit 2 if there were any."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        root = Path(config.hydra.sweep.dir)
        failed = sorted(root.glob(f"*/{ERROR_FILE}"), key=lambda p: p.parent.name)
        if not failed:
            return
        jobs = {
            p.parent.parent.name: [str(o) for o in OmegaConf.load(p)]
            for p in root.glob("*/.hydra/overrides.yaml")
        }
        varying = set.union(set(), *jobs.values()) - set.intersection(*map(set, jobs.values()))
        lines = [f"error: {len(failed)} job(s) of the sweep in {root} failed:"]
        for path in failed:
            which = " ".join(o for o in jobs.get(path.parent.name, []) if o in varying)
            lines.append(f"  job {path.parent.name} ({which}): {path.read_text().strip()}")
        print("\n".join(lines), file=sys.stderr)
        sys.exit(EXIT_CODE)


def check_overrides(argv: list[str], config_dir: Path, config_name: str) -> None:
    """Exit 2 with one line for an override that cannot compose, before Hydra runs: an unknown
    group option (with the valid ones), a key that does not exist (with the close matches and
    the valid keys), a value of the wrong type. Other flags (--cfg, --help, ...) and malformed
    overrides are left to Hydra."""
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return
    try:
        jobs = _one_job_per_value([a for a in argv if not a.startswith("-")])
    except Exception:  # unparsable: Hydra reports it in its own words
        return
    for job_argv in jobs:
        _check_job(job_argv, config_dir, config_name)


def _one_job_per_value(argv: list[str]) -> list[list[str]]:
    """Each swept value once: the first job takes every sweep's first value, and each other
    job changes one sweep to one of its other values. Non-enumerable sweeps (Optuna's
    interval) are left out, as the sweeper will choose them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values: list[list[str]] = []
    for arg, o in zip(argv, OverridesParser.create().parse_overrides(argv), strict=True):
        if not o.is_sweep_override():
            values.append([arg])
            continue
        prefix = arg[: len(arg) - len(arg.lstrip("+~"))] + o.get_key_element()
        try:
            values.append([f"{prefix}={v}" for v in o.sweep_string_iterator()])
        except Exception:
            pass
    jobs = [[v[0] for v in values]]
    for i, v in enumerate(values):
        jobs += [[*jobs[0][:i], other, *jobs[0][i + 1 :]] for other in v[1:]]
    return jobs


def _check_job(argv: list[str], config_dir: Path, config_name: str) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    def composed(overrides):
        with initialize_config_dir(str(config_dir), version_base="1.3"):
            return compose(config_name, overrides=overrides)

    try:
        composed(argv)
        return
    except MissingConfigException as e:  # an option of a group that does not exist
        group, _, choice = str(e.missing_cfg_file).rpartition("/")
        if not any(a.lstrip("+~").startswith(f"{group}=") and choice in a for a in argv):
            return  # not the user's choice: Hydra reports it in its own words
        valid = e.options or sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
        fail(f"{group}={choice} is not an option; valid: {', '.join(valid)}")
    except ConfigCompositionException as e:
        cause = e.__cause__
    except Exception:  # anything else (syntax, ...): Hydra reports it in its own words
        return
    key = getattr(cause, "full_key", None)
    if not key:
        return
    bad = next((a for a in argv if a.lstrip("+~").startswith(key)), "")
    if isinstance(cause, ValidationError):
        fail(f"{bad or key}: {str(cause.msg).splitlines()[0]}")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        parent, _, name = key.rpartition(".")
        try:
            node = composed([a for a in argv if a != bad])
            valid = sorted(str(k) for k in (OmegaConf.select(node, parent) if parent else node))
        except Exception:
            valid = []
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean {(parent + '.') if parent else ''}{close[0]}? " if close else ""
        fail(
            f"{key} is not a config key; {hint}valid keys of {parent or 'the config'}: {', '.join(valid)}"
        )
