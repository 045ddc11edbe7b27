"""Hydra multirun + Lightning DDP on one node: each job of a sweep runs on all its ranks.

Lightning starts ranks > 0 by re-running ``sys.argv`` with ``hydra.run.dir=<HydraConfig
run.dir>`` (lightning.fabric.strategies.launchers.subprocess_script._hydra_subprocess_cmd).
In a multirun that argv still holds ``-m`` and the sweep, so each child would run the whole
sweep again, in a fresh ``runs/`` folder instead of this job's. And the next job of the
sweep would find the finished job's process group still set up, its peers gone, and the
LOCAL_RANK that Lightning exported, which tells it that someone else starts the ranks.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import read_write


@contextlib.contextmanager
def job():
    """Around one Hydra job: DDP children re-run exactly this job, in its directory, and
    the process group and the variables Lightning exports for the ranks end with the job."""
    env = None
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        env = dict(os.environ)
        hc = HydraConfig.get()
        # The job's own overrides (the sweeper's choices included); RUN beats a search
        # config's `hydra.mode: MULTIRUN`.
        sys.argv = [sys.argv[0], *hc.overrides.task, "hydra.mode=RUN"]
        with read_write(hc.run):
            hc.run.dir = hc.runtime.output_dir
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
