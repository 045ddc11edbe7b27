"""The command line: `train.py`, `eval.py` and the other entries hand over here.

Before Hydra runs, an override that cannot compose gets one line and exit 2 (Hydra's own message
spans several lines and does not say what would be valid), in a `-m` sweep too: each swept
value is composed once. In a sweep, a job whose values are wrong for it fails alone (its error
goes to `<job dir>/error.txt`) and the sweep ends with a summary naming the failed jobs.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import importlib.metadata
import logging
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode

# Private name of Lightning's (SweepRanks replaces it during a sweep job; tests/test_ddp.py checks
# that Lightning still calls it): lightning.pytorch.strategies.launchers.subprocess_script.
# _launch_process_observer, the thread that watches the ranks `ddp` starts.
from lightning.pytorch.strategies.launchers import subprocess_script as _launcher
from omegaconf import DictConfig, OmegaConf, read_write

from cifar_amp import config
from cifar_amp.errors import (
    EXIT_CODE,
    REPORTED,
    declared,
    fail,
    missing_package,
    one_line,
    reported,
)

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
    group, the ranks and the environment end with it (SweepRanks)."""

    @functools.wraps(task)
    def run(cfg: DictConfig):
        # Lightning, imported before Hydra set up logging, logs to a stderr handler of its own:
        # hand its records to Hydra's (the console, the run's log file); stderr is for errors.
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
        hc = HydraConfig.get() if HydraConfig.initialized() else None
        try:
            if hc is not None and hc.mode == RunMode.MULTIRUN:
                return _sweep_job(task, cfg, hc)
            if hc is not None and os.environ.get(SWEEP_JOB) == hc.runtime.output_dir:
                return _sweep_job_rank(task, cfg, Path(hc.runtime.output_dir))
            with reported():
                return task(cfg)
        finally:
            _end_process_group()

    return run


def _end_process_group() -> None:
    """Destroy the DDP process group before the interpreter ends: a rank that exits with it
    alive can die of SIGABRT while gloo's threads free their work (pytorch/pytorch#179291),
    which a sweep reports as a failed job."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


SWEEP_JOB = "CIFAR_AMP_SWEEP_JOB"  # set for the ranks > 0 of a sweep job: the job's dir
RANK_GRACE_S = 60  # how long a sweep job's ranks > 0 get to end after rank 0 has


def _sweep_job(task: Callable[[DictConfig], Any], cfg: DictConfig, hc) -> Any:
    """A job of a sweep: its failure is its own (`error.txt`, NaN), whichever rank failed."""
    job_dir = Path(hc.runtime.output_dir)
    env, argv = dict(os.environ), sys.argv
    sys.argv = [sys.argv[0], *hc.overrides.task, "hydra.mode=RUN"]  # RUN beats a `-m` config
    with read_write(hc.run):
        hc.run.dir = str(job_dir)
    os.environ[SWEEP_JOB] = str(job_dir)
    try:
        return _failing_alone(task, cfg, job_dir)
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(env)


def _failing_alone(task: Callable[[DictConfig], Any], cfg: DictConfig, job_dir: Path) -> Any:
    full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    value = math.nan
    try:
        with SweepRanks() as ranks:
            try:
                value = task(cfg)
            except REPORTED as e:
                if full:
                    raise
                # Recorded before the ranks end: a rank > 0 then fails for want of this one,
                # and finds the job's error here.
                _record(job_dir, one_line(e))
        if ranks.failed:
            _record(job_dir, ranks.failed)
    except Exception:
        if full or not (job_dir / ERROR_FILE).is_file():  # not a refusal: a bug, shown whole
            raise
    if not (job_dir / ERROR_FILE).is_file():
        return value
    log.error("%s", (job_dir / ERROR_FILE).read_text().strip())
    return math.nan


def _sweep_job_rank(task: Callable[[DictConfig], Any], cfg: DictConfig, job_dir: Path) -> Any:
    """A rank > 0 of a sweep's job (Lightning started it; the job's rank 0 is the sweep). Its
    refusal is recorded as the job's unless another rank's came first; it exits without a line
    on stderr: the sweep's summary names the job."""
    try:
        return task(cfg)
    except REPORTED as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _record(job_dir, one_line(e))
        log.error("%s", one_line(e))
        sys.exit(EXIT_CODE)
    except Exception as e:
        if not (job_dir / ERROR_FILE).is_file():
            raise
        # A peer failed (recorded) and left: what this rank then meets is a consequence.
        log.error("this rank stops, the job has failed: %s: %s", type(e).__name__, one_line(e))
        sys.exit(EXIT_CODE)


def _record(job_dir: Path, msg: str) -> None:
    """`<job dir>/error.txt`, unless a rank of the job has written it: the first error wins."""
    with contextlib.suppress(FileExistsError), open(job_dir / ERROR_FILE, "x") as f:
        f.write(msg + "\n")


class SweepRanks:
    """Around a sweep job: the ranks > 0 Lightning starts for it are this job's, ended with it.

    Lightning's launcher for `ddp` starts them with Popen and a thread that, when one exits
    non-zero, SIGKILLs them all and this process, which in a sweep is the sweep; the thread
    also outlives the job. So in a sweep job the ranks are kept here instead: when the job
    ends, its process group is destroyed (a rank still waiting on rank 0 fails then), the
    ranks get RANK_GRACE_S to end, and those still running are killed. `failed` names a rank
    that exited non-zero."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.failed = ""

    def __enter__(self) -> SweepRanks:
        self._observe = _launcher._launch_process_observer
        _launcher._launch_process_observer = self.procs.extend
        return self

    def __exit__(self, *exc) -> None:
        _launcher._launch_process_observer = self._observe
        _end_process_group()  # a rank > 0 still waiting on this one fails now
        deadline = time.monotonic() + RANK_GRACE_S
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode and not self.failed:
                self.failed = f"rank {rank} of this job exited with code {proc.returncode}"


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
    the valid keys), a value of the wrong type, a sweep's sweeper or launcher whose package is
    not installed. Other flags (--cfg, --help, ...) and malformed overrides are left to Hydra."""
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        jobs = _one_job_per_value(overrides)
    except Exception:  # unparsable: Hydra reports it in its own words
        return
    if config_name != "train":
        _check_entry_keys(overrides, config_dir, config_name)
    multirun = "-m" in argv or "--multirun" in argv
    for job_argv in jobs:
        _check_job(job_argv, config_dir, config_name, multirun)


def _check_plugins(hydra_cfg: DictConfig, argv: list[str]) -> None:
    """A sweep's sweeper or launcher whose module needs a package that is not installed: one
    line with its pip command (Hydra: a traceback, at the start of the sweep)."""
    for group in ("sweeper", "launcher"):
        target = OmegaConf.select(hydra_cfg, f"{group}._target_") or ""
        try:
            importlib.import_module(target.rpartition(".")[0])
        except ImportError as e:
            if missing := missing_package(e):
                fail(f"{_chosen(argv, f'hydra/{group}') or f'hydra/{group}'} needs {missing}")


def _chosen(argv: list[str], group: str) -> str | None:
    """The user's override of config group `group` (`hydra/launcher=slurm`), if any."""
    return next((a for a in argv if a.lstrip("+~").startswith(f"{group}=")), None)


def _missing_plugin(group: str, choice: str, argv: list[str]) -> None:
    """A config of Hydra's own groups that an option of ours names and none here provides
    (hydra/launcher=slurm -> submitit_slurm): the Hydra plugin is not installed; one line."""
    chosen = _chosen(argv, group)
    if not (chosen and group.startswith("hydra/")):
        return
    absent = []
    for name, how in declared().items():
        if name.startswith("hydra-"):
            try:
                importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                absent.append(f"{name}, which is not installed here: {how}")
    fail(
        f"{chosen} needs {group}/{choice}, a config of a Hydra plugin: "
        + ("; ".join(absent) or "no installed package provides it")
    )


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


def _check_entry_keys(argv: list[str], config_dir: Path, config_name: str) -> None:
    """An override of train.py's that this entry (eval, predict, export) does not take: one
    line saying where the entry takes it from (the checkpoint) or that it is train.py's, and
    the entry's keys. Hydra would stop at a group (`model=...`) with advice to append it
    (`+model=...`), which it then accepts and ignores."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    def keys(name: str) -> set[str]:
        with initialize_config_dir(str(config_dir), version_base="1.3"):
            return {str(k) for k in compose(name)} - {"hydra"}

    tops = {
        arg: o.key_or_group.split(".")[0].split("@")[0]
        for arg, o in zip(argv, OverridesParser.create().parse_overrides(argv), strict=True)
    }
    ours = keys(config_name)
    if all(top in ours or top == "hydra" for top in tops.values()):
        return
    groups = {p.name for p in config_dir.iterdir() if p.is_dir()}
    theirs = (keys("train") | groups) - ours - {"hydra", "schema"}
    script = config_dir.parent / f"{config_name}.py"
    entry = script.name if script.is_file() else f"cifar_amp.{config_name}"
    valid = ", ".join(sorted(ours))
    for arg, top in tops.items():
        if top in config.FROM_CHECKPOINT and top in theirs:
            fail(
                f"{arg}: {entry} takes {config.FROM_CHECKPOINT[top]} from the checkpoint "
                f"(ckpt_path), not from {top}; its keys: {valid}"
            )
        if top in theirs:
            fail(f"{arg}: {entry} takes no {top} (a train.py setting); its keys: {valid}")


def _check_job(argv: list[str], config_dir: Path, config_name: str, multirun: bool) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    def composed(overrides, hydra=False):
        with initialize_config_dir(str(config_dir), version_base="1.3"):
            return compose(config_name, overrides=overrides, return_hydra_config=hydra)

    try:
        cfg = composed(argv, hydra=True)
        if multirun or cfg.hydra.mode == RunMode.MULTIRUN:
            _check_plugins(cfg.hydra, argv)
        return
    except MissingConfigException as e:  # an option of a group that does not exist
        group, _, choice = str(e.missing_cfg_file).rpartition("/")
        if not any(a.lstrip("+~").startswith(f"{group}=") and choice in a for a in argv):
            _missing_plugin(group, choice, argv)
            return  # not the user's choice: Hydra reports it in its own words
        valid = e.options or sorted(p.stem for p in (config_dir / group).glob("*.yaml"))
        fail(f"{group}={choice} is not an option; valid: {', '.join(valid)}")
    except ConfigCompositionException as e:
        # Raised inside a config file (a recipe's), the error is the context, not the cause.
        cause, source = e.__cause__ or e.__context__, re.match(r"In '([^']+)/([^'/]+)'", str(e))
    except Exception:  # anything else (syntax, ...): Hydra reports it in its own words
        return
    key = getattr(cause, "full_key", None)
    if not key:
        return
    bad = next((a for a in argv if a.lstrip("+~").startswith(key)), "")
    parent, _, name = key.rpartition(".")
    if not bad and source and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        option = f"{source[1]}={source[2]}"  # e.g. experiment=cpu_quick, setting model.widths
        chosen = next((a for a in argv if a.lstrip("+~").split("=")[0] == parent), parent)
        try:
            node = composed([a for a in argv if a != option])
            valid = sorted(str(k) for k in OmegaConf.select(node, parent))
        except Exception:
            valid = []
        fail(f"{option} sets {key}, which {chosen} does not take; its keys: {', '.join(valid)}")
    if isinstance(cause, ValidationError):
        fail(f"{bad or key}: {str(cause.msg).splitlines()[0]}")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
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
