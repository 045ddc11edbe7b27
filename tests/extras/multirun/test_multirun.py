"""The multirun extra (src/cifar_amp/extras/multirun/multirun.py): in a `-m` sweep a job whose values are wrong
fails alone, on any DDP rank, its ranks end with it, and the sweep ends with a summary naming it."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.plugins.environments import LightningEnvironment
from omegaconf import open_dict

from cifar_amp import cli
from cifar_amp.errors import UserError
from cifar_amp.extras.multirun import compat, multirun
from conftest import REPO, SHRINK, compose_cfg
from test_ddp import run_in_session


@pytest.mark.slow  # a -m sweep of the command
def test_a_sweep_job_that_refuses_fails_alone_through_the_configured_callback(tmp_path):
    # src/cifar_amp/extras/multirun/configs/hydra/sweep_jobs adds the callback; cli.job finds its run_job there.
    cfg = compose_cfg("train", ["seed=3"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.runtime.output_dir = str(tmp_path)
    HydraConfig.instance().set_config(cfg)

    def task(cfg):
        raise UserError("seed=3: refused")

    try:
        assert math.isnan(cli.job(task)(cfg))
    finally:
        HydraConfig.instance().cfg = None
    assert (tmp_path / multirun.ERROR_FILE).read_text() == "seed=3: refused\n"


@pytest.mark.slow
def test_a_bad_value_fails_its_job_alone_and_the_sweep_names_it(tmp_path, tiny_data):
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "data.batch_size=16,0",
            *(o for o in SHRINK if not o.startswith("data.batch_size")),
            f"data.data_dir={tiny_data}",
            f"hydra.sweep.dir={tmp_path}/sweep",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (tmp_path / "sweep" / "0" / "metrics.json").is_file()  # the good job ran
    assert "1 job(s) of the sweep" in r.stderr
    assert "job 1 (data.batch_size=0): invalid config value for data.batch_size: 0" in r.stderr


@pytest.mark.slow
def test_multirun_of_ddp_jobs_makes_one_run_dir_per_job(tmp_path, tiny_data):
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        *SHRINK,
        "trainer=ddp_cpu",
        f"data.data_dir={tiny_data}",
        f"hydra.sweep.dir={sweep}",
        "module.label_smoothing=0.0,0.1",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job, smoothing in (("0", "0.0"), ("1", "0.1")):
        assert len(list((sweep / job).rglob("metrics.json"))) == 1
        # rank 1 ran this job (its own log, in this job's folder), not a sweep of its own
        assert (sweep / job / "train_ddp_process_1.log").is_file()
        assert f"label_smoothing: {smoothing}" in (sweep / job / "config.yaml").read_text()
    assert not (tmp_path / "logs").exists()  # no stray runs/ or multiruns/ from the children


def test_sweep_ranks_keep_lightnings_ranks_and_end_them(monkeypatch):
    # Lightning's ddp launcher hands the ranks it starts to the module-level name SweepRanks
    # replaces (a private name: this fails if Lightning stops calling it).
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    # Set, so that launch() leaves this process's threads and environment alone: it would set
    # OMP_NUM_THREADS here for good, and a later test's forked ranks would then start OpenMP
    # teams that libgomp cannot run after a fork (they hang).
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    ok = subprocess.Popen([sys.executable, "-c", "pass"])
    launcher = compat.ddp_launcher(LightningEnvironment(), lambda: [ok])
    with multirun.SweepRanks() as ranks:
        assert launcher.launch(lambda: 42) == 42
    assert ranks.procs == [ok] and ok.returncode == 0 and ranks.failed == ""
    restored = compat.swap_process_observer(print)  # SweepRanks put Lightning's back
    assert restored.__module__.startswith("lightning.")
    compat.swap_process_observer(restored)


def test_sweep_ranks_name_a_failed_rank_and_kill_one_that_does_not_end(monkeypatch):
    monkeypatch.setattr(multirun, "RANK_GRACE_S", 1.0)
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with multirun.SweepRanks() as ranks:
        ranks.procs += [failing, stuck]
    assert ranks.failed == "rank 1 of this job exited with code 3"
    assert stuck.returncode == -signal.SIGKILL


# Raises a UserError on the ranks named by `fail_on` when training starts; a rank that does not
# fail then finds its peer gone at DDP's first gradient all-reduce.
FAILING_CALLBACK = """
from lightning.pytorch import Callback
from cifar_amp.errors import UserError

class FailOn(Callback):
    def __init__(self, fail_on: str = "none"):
        self.fail_on = fail_on

    def on_train_start(self, trainer, pl_module):
        rank = trainer.global_rank
        if self.fail_on in ("all", f"rank{rank}"):
            raise UserError(f"fail_on={self.fail_on}: rank {rank} refuses")
"""


@pytest.mark.slow
def test_a_ddp_job_that_fails_on_any_rank_fails_alone_and_leaves_no_process(tmp_path, tiny_data):
    # Lightning's watcher of the ranks SIGKILLed the sweep when a rank exited non-zero, and
    # left a rank of the next job running with no parent.
    (tmp_path / "failing_cb.py").write_text(textwrap.dedent(FAILING_CALLBACK))
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "-m",
        *SHRINK,
        "trainer=ddp_cpu",
        "logger=csv",
        f"data.data_dir={tiny_data}",
        f"hydra.sweep.dir={tmp_path}/sweep",
        "+callbacks.fail._target_=failing_cb.FailOn",
        "+callbacks.fail.fail_on=rank1,all,rank0,none",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(tmp_path)])}
    r, left = run_in_session(tmp_path, cmd, env)
    assert left == []
    assert r.returncode == 2, r.stderr[-3000:]
    assert "error: 3 job(s) of the sweep" in r.stderr
    assert "job 0 (+callbacks.fail.fail_on=rank1): fail_on=rank1: rank 1 refuses" in r.stderr
    assert "job 1 (+callbacks.fail.fail_on=all): fail_on=all: rank " in r.stderr
    assert "job 2 (+callbacks.fail.fail_on=rank0): fail_on=rank0: rank 0 refuses" in r.stderr
    assert "Traceback" not in r.stderr
    assert json.loads((tmp_path / "sweep" / "3" / "metrics.json").read_text())["epochs"] == 1
