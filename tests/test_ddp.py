"""Two CPU processes (DDP over gloo): per-rank sharding, metric reduction across ranks, every
strategy Lightning offers for them (DDP jobs of a sweep: tests/extras/multirun/test_multirun.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry
from omegaconf import OmegaConf

from cifar_amp import build, cli, metrics
from cifar_amp.errors import UserError
from cifar_amp.module import ImageClassifier
from conftest import CPU_DDP, REPO, SHRINK

TWO_RANKS = ("trainer.accelerator=cpu", "trainer.devices=2", f"trainer.strategy={CPU_DDP}")


class RecordLabels(Callback):
    """Appends each training batch's labels to <out>/rank<r>_epoch<e>.txt."""

    def __init__(self, out):
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        path = self.out / f"rank{trainer.global_rank}_epoch{trainer.current_epoch}.txt"
        with open(path, "a") as f:
            f.write(" ".join(map(str, batch[1].tolist())) + "\n")


def plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True)


def labels_per_epoch(cfg, dm, n: int, out, epochs: int = 2) -> list[list[list[int]]]:
    """Fit on two ranks a module with one class per training sample (the label is its index);
    the labels each rank trained on, per epoch: [epoch][rank]."""
    sgd = {"_target_": "torch.optim.SGD", "lr": 0.01}
    # Plain containers: a spawned rank unpickles the module, and a schema-typed DictConfig
    # does not pickle.
    module = ImageClassifier(net=plain(cfg.model), num_classes=n, optimizer=sgd)
    build.trainer(cfg, callbacks=[RecordLabels(out)], loggers=[]).fit(module, datamodule=dm)
    return [
        [[int(v) for v in (out / f"rank{r}_epoch{e}.txt").read_text().split()] for r in (0, 1)]
        for e in range(epochs)
    ]


def test_two_ranks_see_every_training_sample_once_per_epoch(make_cfg, tmp_path):
    # 180 training images, 2 ranks x 6 batches of 15: nothing is dropped.
    cfg = make_cfg(
        *TWO_RANKS, "trainer.max_epochs=2", "data.batch_size=15", "callbacks=none", "test=false"
    )
    dm = build.datamodule(cfg)
    dm.setup()
    images, _ = dm.splits["train"]
    n = len(images)
    dm.splits["train"] = (images, torch.arange(n))  # label = sample index, one class each
    orders = []
    for ranks in labels_per_epoch(cfg, dm, n, tmp_path):
        assert len(ranks[0]) == len(ranks[1]) == n // 2
        assert sorted(ranks[0] + ranks[1]) == list(range(n))  # the union is the set, no overlap
        orders.append(ranks[0])
    assert orders[0] != orders[1]  # a fresh permutation each epoch (Lightning's set_epoch)


def test_two_rank_test_metrics_equal_one_rank(make_cfg, tmp_path):
    # 60 test images: one rank sees batches of 32 + 28, two ranks 30 each.
    one = make_cfg("trainer=cpu", "data.eval_batch_size=32")
    two = make_cfg(*TWO_RANKS, "data.eval_batch_size=32")
    module = ImageClassifier(net=plain(one.model), num_classes=10)
    ref = build.trainer(one).test(module, datamodule=build.datamodule(one), verbose=False)[0]
    got = build.trainer(two).test(module, datamodule=build.datamodule(two), verbose=False)[0]
    assert got[metrics.TEST_ACC] == pytest.approx(ref[metrics.TEST_ACC], abs=1e-6)
    assert got[metrics.TEST_LOSS] == pytest.approx(ref[metrics.TEST_LOSS], rel=1e-5)


PER_STAGE = sorted(n for n in StrategyRegistry if build.per_stage_ranks(n))


def test_strategies_whose_ranks_are_started_per_stage_are_known():
    assert {
        "ddp_spawn",
        "ddp_fork",
        "ddp_notebook",
        "ddp_spawn_find_unused_parameters_true",
    } <= set(PER_STAGE)
    assert build.per_stage_ranks("ddp") is None and build.per_stage_ranks("auto") is None
    node = OmegaConf.create(
        {"_target_": "lightning.pytorch.strategies.DDPStrategy", "start_method": "spawn"}
    )
    assert build.per_stage_ranks(node) == "spawn"


@pytest.mark.parametrize("fails", [False, True])
def test_a_command_ends_its_process_group_before_it_exits(fails):
    # A rank that exits with its gloo process group alive can die of SIGABRT at interpreter
    # teardown: a DDP sweep job then fails for no reason of its own.
    def task(cfg):
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        if fails:
            raise UserError("refused")
        return 7

    if fails:
        with pytest.raises(SystemExit):
            cli.job(task)(OmegaConf.create())
    else:
        assert cli.job(task)(OmegaConf.create()) == 7
    assert not torch.distributed.is_initialized()


def _session(sid: int) -> list[str]:
    """The processes of session `sid` still running: pid and command line."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                with open(f"/proc/{d}/cmdline") as f:
                    found.append(f"{d}: {f.read().replace(chr(0), ' ')[:200]}")
        except (OSError, IndexError, ValueError):
            continue
    return found


def run_in_session(tmp_path, cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, list]:
    """Run `cmd` in a session of its own, so that a process whose parent died is still found;
    the result and the processes of the session left running (killed, so a test leaks none)."""
    # Output to files, not pipes: a rank left running would hold a pipe open.
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=out, stderr=err, start_new_session=True
        )
        try:
            proc.wait(timeout=500)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    left = _session(proc.pid)
    for _ in range(20):  # a rank of the last job may be exiting just now
        if not left:
            break
        time.sleep(0.5)
        left = _session(proc.pid)
    for line in left:
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), left


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_ddp_and_ddp_spawn_on_two_cpu_processes_train_test_and_report(
    tmp_path, tiny_data, strategy
):
    # ddp_spawn's ranks are started once by the command, as ddp's: a second start for the test
    # stage crashed in the CSV logger, and metrics.json said 0 epochs.
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        *SHRINK,
        "trainer.max_epochs=2",
        "trainer.devices=2",
        f"trainer.strategy={strategy}",
        "logger=csv",
        f"data.data_dir={tiny_data}",
        f"run_dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    r, left = run_in_session(tmp_path, cmd, env)
    assert r.returncode == 0 and left == [], r.stderr[-3000:]
    result = json.loads((run_dir / "metrics.json").read_text())
    assert result["epochs"] == 2 and metrics.TEST_ACC in result and metrics.VAL_ACC in result
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {metrics.VAL_ACC, metrics.TRAIN_LOSS, metrics.TEST_ACC} <= set(header)
