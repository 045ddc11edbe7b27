"""Runs never share or clobber a run dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import compat
from conftest import REPO, SHRINK

QUICK = (*SHRINK, "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false")


def _start(cwd, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, str(REPO / "train.py"), *QUICK, *args]
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_runs_started_together_get_their_own_dirs_and_a_used_dir_is_refused(tmp_path, tiny_data):
    procs = [_start(tmp_path, f"data.data_dir={tiny_data}", f"seed={i}") for i in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0], [p.stderr.read() for p in procs]
    runs = sorted((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        assert (run / "metrics.json").is_file() and (run / "checkpoints" / "last.ckpt").is_file()

    again = _start(tmp_path, f"data.data_dir={tiny_data}", f"hydra.run.dir={runs[0]}")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 2
    assert f"error: run dir {runs[0]} already holds a run; resume it with ckpt_path=" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_multirun_jobs_get_their_own_dirs(tmp_path, tiny_data):
    proc = _start(tmp_path, f"data.data_dir={tiny_data}", "seed=1,2", "-m")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    for job in ("0", "1"):
        assert (sweep / job / "metrics.json").is_file()


SLURM_ENV = {
    "SLURM_NTASKS": "1",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


def test_slurm_requeue_is_on_and_may_reuse_its_run_dir(make_cfg, monkeypatch, tmp_path):
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from cifar_amp import build
    from cifar_amp.errors import UserError
    from cifar_amp.resume import source as resume_source
    from cifar_amp.runs import claim

    for k, v in SLURM_ENV.items():
        monkeypatch.setenv(k, v)
    env = compat.accelerator_connector(build.trainer(make_cfg())).cluster_environment
    assert (
        isinstance(env, SLURMEnvironment)
        and env.auto_requeue
        and env.requeue_signal == signal.SIGUSR1
    )
    (tmp_path / "config.yaml").write_text("{}")
    cfg = make_cfg()  # in tmp_path, no ckpt_path: as the requeued job starts
    assert resume_source(cfg) is None
    with pytest.raises(UserError), claim(str(tmp_path), resuming=False):
        pass  # a used dir with nothing to resume from
    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"")  # written by Lightning on the requeue signal
    assert resume_source(cfg) == tmp_path / "hpc_ckpt_1.ckpt"  # so the job resumes from it
    with claim(str(tmp_path), resuming=True):
        pass


def test_a_run_dir_in_use_is_refused_until_its_run_ends(tmp_path):
    from cifar_amp.errors import UserError
    from cifar_amp.runs import claim

    with claim(str(tmp_path), resuming=False):
        with pytest.raises(UserError) as e, claim(str(tmp_path), resuming=True):
            pass
        assert str(e.value) == (
            f"run dir {tmp_path} is in use by another run (it holds {tmp_path / '.lock'}); "
            "wait for that run to end or pick a new hydra.run.dir"
        )
    with claim(str(tmp_path), resuming=True):  # released on exit
        pass


HOLD = (
    "import sys; from cifar_amp.runs import claim; "
    "c = claim(sys.argv[1], False); c.__enter__(); print('held', flush=True); sys.stdin.read()"
)


@pytest.mark.slow
def test_train_py_in_a_run_dir_another_process_holds_is_refused(tmp_path, tiny_data):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        second = _start(tmp_path, f"data.data_dir={tiny_data}", f"hydra.run.dir={run_dir}")
        _, err = second.communicate(timeout=300)
    finally:
        holder.communicate("")  # released when the holder exits
    assert second.returncode == 2, err
    assert err.strip().splitlines()[-1] == (
        f"error: run dir {run_dir} is in use by another run (it holds {run_dir / '.lock'}); "
        "wait for that run to end or pick a new hydra.run.dir"
    )
    assert not (run_dir / "config.yaml").exists()  # refused before anything was written


def test_callbacks_none_writes_a_checkpoint_the_command_line_can_take(make_cfg, tmp_path):
    # Lightning's own checkpoint, added where none is configured, was epoch=0-step=7.ckpt: Hydra's
    # grammar refused `eval.py ckpt_path=.../epoch=0-step=7.ckpt` ("mismatched input '='").
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from cifar_amp.training import train

    tested = train(make_cfg("callbacks=none"))["tested_ckpt"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["last.ckpt"]
    assert tested == str(tmp_path / "checkpoints" / "last.ckpt")
    assert OverridesParser.create().parse_overrides([f"ckpt_path={tested}"])[0].value() == tested
