"""SaveOnSignal under DDP: the ranks share whether one had a signal every few steps instead of
Lightning's broadcast at every step, all stop at the same accumulation-window end, one
checkpoint, and the resume is exact."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch

from cifar_amp import build
from cifar_amp.extras.reliability import compat
from cifar_amp.extras.reliability.reliability import SaveOnSignal
from cifar_amp.module import ImageClassifier
from conftest import REPO, SHRINK
from test_ddp import TWO_RANKS, _session, plain, run_in_session
from test_resume import EXACT, assert_same_weights, comparable


class CountBroadcasts(L.Callback):
    """Counts torch.distributed.broadcast calls and training batches from on_train_start to
    on_train_end, into <out>/rank<r>.json."""

    def __init__(self, out) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        self.counts = {"broadcasts": 0, "batches": 0}
        self.real = torch.distributed.broadcast

        def counted(*args, **kwargs):
            self.counts["broadcasts"] += 1
            return self.real(*args, **kwargs)

        torch.distributed.broadcast = counted

    def on_train_batch_end(self, *_) -> None:
        self.counts["batches"] += 1

    def on_train_end(self, trainer, pl_module) -> None:
        torch.distributed.broadcast = self.real
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.counts))


class CountDecisions(SaveOnSignal):
    """SaveOnSignal that counts its shared decisions, into <out>/decisions<r>.json."""

    def __init__(self, out, share_every: int) -> None:
        super().__init__(share_every)
        self.out, self.decisions = out, 0

    def _decide(self, trainer) -> None:
        self.decisions += 1
        super()._decide(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        (self.out / f"decisions{trainer.global_rank}.json").write_text(str(self.decisions))


def fit_two_ranks(make_cfg, out, callbacks) -> list[dict]:
    """One epoch of 11 batches per rank (180 images, batches of 8), 2 CPU ranks: what
    CountBroadcasts counted on each."""
    cfg = make_cfg(*TWO_RANKS, "data.batch_size=8", "callbacks=none", "test=false")
    module = ImageClassifier(net=plain(cfg.model), num_classes=10, optimizer=cfg.module.optimizer)
    trainer = build.trainer(cfg, callbacks=[*callbacks, CountBroadcasts(out)], loggers=[])
    trainer.fit(module, datamodule=build.datamodule(cfg))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_lightning_still_broadcasts_its_sigterm_flag_at_every_step(make_cfg, tmp_path):
    """What SaveOnSignal turns off: if a Lightning release stops making this call (or renames
    the method), this fails, and compat.no_flag_broadcast_per_step can go."""
    assert compat.lightning_broadcasts_sigterm_flag()
    for rank in fit_two_ranks(make_cfg, tmp_path, []):
        assert rank == {"broadcasts": 11, "batches": 11}


def test_under_ddp_the_ranks_share_the_flag_every_n_steps_not_at_every_step(make_cfg, tmp_path):
    counted = CountDecisions(tmp_path, share_every=4)
    for r, rank in enumerate(fit_two_ranks(make_cfg, tmp_path, [counted])):
        assert rank == {"broadcasts": 0, "batches": 11}
        # after steps 4 and 8 of 11, and after the validation at the epoch's end
        assert (tmp_path / f"decisions{r}.json").read_text() == "3"


def ddp_cli(tiny_data, run_dir, *extra: str) -> list[str]:
    """2 CPU ranks, batches of 4: 22 batches per rank and epoch, 2 epochs."""
    args = [
        *(o for o in SHRINK if o != "trainer=cpu"),
        "trainer=ddp_cpu",
        *EXACT,
        "trainer.max_epochs=2",
        "data.batch_size=4",
        "callbacks.save_on_signal.share_every=2",
        f"data.data_dir={tiny_data}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    return [sys.executable, str(REPO / "train.py"), *args]


ENV = {**os.environ, "PYTHONPATH": str(REPO / "src")}


@pytest.mark.slow
@pytest.mark.parametrize("accumulate", [3])  # windows of 3, and an epoch's last of 1
def test_ddp_a_signal_to_the_command_stops_every_rank_at_one_step_and_resumes_exactly(
    tmp_path, tiny_data, accumulate
):
    acc = f"trainer.accumulate_grad_batches={accumulate}"
    ref, run = tmp_path / "ref", tmp_path / "run"
    (ref_dir := tmp_path / "r").mkdir()
    done, left = run_in_session(ref_dir, ddp_cli(tiny_data, ref, acc), ENV)
    assert done.returncode == 0 and left == [], done.stderr[-3000:]

    # SIGTERM to the command (rank 0, which started rank 1) once a step checkpoint is written.
    last = run / "checkpoints" / "last.ckpt"
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(
            ddp_cli(tiny_data, run, acc),
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    time.sleep(2)  # rank 1 may be exiting just now
    left = _session(proc.pid)
    for line in left:
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    stderr = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 128 + signal.SIGTERM and left == [], stderr[-3000:]
    assert "Traceback" not in stderr
    said = [ln for ln in stderr.splitlines() if ln.startswith("SIGTERM: stopped at epoch ")]
    assert len(said) == 1, stderr[-3000:]  # rank 0 says it, once

    saved = torch.load(last, weights_only=False)
    step = saved["global_step"]
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"]
    assert 0 < step < 2 * -(-22 // accumulate), "the signal did not land partway"
    assert batches % accumulate == 0 or batches == 22  # at a window's end
    assert f"step {step};" in said[0]
    assert f"rank 1: stopped at step {step}" in (run / "train_ddp_process_1.log").read_text()

    command = shlex.split(said[0].split("Resume with: ", 1)[1])
    resumed, left = run_in_session(tmp_path, [sys.executable, *command[1:]], ENV)
    assert resumed.returncode == 0 and left == [], resumed.stderr[-3000:]
    assert_same_weights(ref, run)
    assert comparable(ref) == comparable(run)
