"""Extra: in a `-m` sweep, a job whose values are wrong fails alone (one line in
`<job dir>/error.txt`, NaN to the sweeper), whichever DDP rank failed, and the sweep ends with a
summary naming the failed jobs (exit 2).

Its configs/hydra/sweep_jobs/ adds summary.SweepSummary to Hydra's callbacks, and SweepJobs as
their `job_runner`, through which cli.job runs each job (seams.JobRunner).

Under DDP, Lightning starts ranks > 0 by re-running `sys.argv` with `hydra.run.dir=<the job's
dir>` (lightning.fabric.strategies.launchers.subprocess_script). In a multirun that argv still
holds `-m` and the sweep, so each child would run the whole sweep again; and the next job would
find this one's process group and the LOCAL_RANK Lightning exported (which says that someone
else starts the ranks). So children re-run exactly this job, and the process group, the ranks
and the environment end with it (SweepRanks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, read_write

from cifar_amp.cli import end_process_group
from cifar_amp.errors import EXIT_CODE, REPORTED, one_line, reported
from cifar_amp.extras.multirun import compat
from cifar_amp.seams import JobRunner

log = logging.getLogger(__name__)
ERROR_FILE = "error.txt"  # in a failed sweep job's directory
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
        self._observe = compat.swap_process_observer(self.procs.extend)
        return self

    def __exit__(self, *exc) -> None:
        compat.swap_process_observer(self._observe)
        end_process_group()  # a rank > 0 still waiting on this one fails now
        deadline = time.monotonic() + RANK_GRACE_S
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode and not self.failed:
                self.failed = f"rank {rank} of this job exited with code {proc.returncode}"


class SweepJobs(Callback, JobRunner):
    """`hydra.callbacks.job_runner`: each job of a sweep fails alone."""

    @classmethod
    def run_job(cls, task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
        """Run one Hydra job for cli.job: a sweep's job, or a rank > 0 that Lightning started
        for one, fails alone; any other job is the core's (one line, exit 2)."""
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return _sweep_job(task, cfg, hc)
        if os.environ.get(SWEEP_JOB) == hc.runtime.output_dir:
            return _sweep_job_rank(task, cfg, Path(hc.runtime.output_dir))
        with reported():
            return task(cfg)
