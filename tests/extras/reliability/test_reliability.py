"""The reliability extra: checkpoint writes a kill or a full disk cannot tear, SIGTERM/Ctrl+C
that save and say how to resume (and resume exactly), a stop on losses that stay non-finite."""

import csv
import errno
import io
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from cifar_amp import build, metrics
from cifar_amp.errors import reported
from cifar_amp.extras.reliability import compat, reliability
from cifar_amp.extras.reliability.reliability import (
    AtomicCheckpointIO,
    AtomicCSVLogger,
    BackgroundCheckpointIO,
    NonFiniteLossError,
)
from cifar_amp.runs import WriteFailed
from cifar_amp.training import train
from conftest import REPO, SHRINK, compose_cfg
from test_full_disk import failed_write, one_line_error
from test_resume import (  # reference_run: a fixture, used by name
    ENV,
    EXACT,
    _start_and_signal,
    assert_same_weights,
    comparable,
    reference_run,
)


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "w": torch.arange(1000.0)}, path)

    def dies_halfway(obj, f, *args, **kwargs):
        f.write(b"\x80\x02 half a pickle")
        raise KeyboardInterrupt  # a signal in the middle of the write

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"step": 2, "w": torch.zeros(1000)}, path)
    monkeypatch.undo()
    kept = torch.load(path, weights_only=True)
    assert kept["step"] == 1 and torch.equal(kept["w"], torch.arange(1000.0))
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temp file left behind


def test_trainer_writes_checkpoints_atomically_on_a_background_thread(make_cfg):
    for precision in ("32-true", "16-mixed"):  # 16-mixed brings its own plugin list
        cfg = make_cfg(f"precision={precision}")
        io = build.trainer(cfg, build.precision(cfg)).strategy.checkpoint_io
        assert type(io) is BackgroundCheckpointIO and type(io.checkpoint_io) is AtomicCheckpointIO
    cfg = make_cfg("trainer/reliability@trainer=sync")
    assert type(build.trainer(cfg, build.precision(cfg)).strategy.checkpoint_io) is (
        AtomicCheckpointIO
    )


class Gate:
    """torch.save that waits for `open` before writing, and notes the thread that wrote."""

    def __init__(self, monkeypatch, fails=lambda obj: False) -> None:
        self.open, self.threads, real = threading.Event(), [], torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(f, io.BufferedWriter):  # a file (not runs._bytes_of's count)
                assert self.open.wait(10)
                self.threads.append(threading.current_thread())
                if fails(obj):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)


def test_a_background_write_holds_the_weights_as_they_were_when_asked(tmp_path, monkeypatch):
    gate, w = Gate(monkeypatch), torch.zeros(1000)
    ckpts = BackgroundCheckpointIO()
    ckpts.save_checkpoint({"w": w}, tmp_path / "last.ckpt")  # returns before the write
    w.add_(1)  # the next optimizer step, in place
    gate.open.set()
    ckpts.teardown()
    assert gate.threads and threading.main_thread() not in gate.threads
    assert torch.equal(
        torch.load(tmp_path / "last.ckpt", weights_only=True)["w"], torch.zeros(1000)
    )


def test_a_failed_background_write_keeps_the_file_it_was_to_replace_and_stops_once(
    tmp_path, monkeypatch
):
    ckpts = BackgroundCheckpointIO()
    old, new, last = (
        tmp_path / n for n in ("best-epoch000.ckpt", "best-epoch001.ckpt", "last.ckpt")
    )
    for path in (old, last):
        ckpts.save_checkpoint({"epoch": 0}, path)
    ckpts.wait()
    gate = Gate(monkeypatch, fails=lambda obj: obj["epoch"] == 1)
    # As ModelCheckpoint asks at a new best: write it, remove the one it replaces, then last.ckpt.
    ckpts.save_checkpoint({"epoch": 1}, new)
    ckpts.remove_checkpoint(old)
    ckpts.save_checkpoint({"epoch": 1}, last)
    gate.open.set()
    with pytest.raises(WriteFailed, match=f"cannot write {new}: No space left on device"):
        ckpts.wait()  # (or the next save, or the end of fit)
    ckpts.save_checkpoint({"epoch": 2}, last)  # a trainer that goes on writes nothing more
    ckpts.teardown()  # and one that failed tears down again: said once
    assert len(gate.threads) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([last.name, old.name])
    assert torch.load(last, weights_only=True)["epoch"] == 0


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoint_gets_the_mode_a_plain_save_would(tmp_path, umask):
    previous = os.umask(umask)
    try:
        torch.save({"w": 1}, tmp_path / "plain.ckpt")
        AtomicCheckpointIO().save_checkpoint({"w": 1}, tmp_path / "atomic.ckpt")
    finally:
        os.umask(previous)
    modes = [stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("plain.ckpt", "atomic.ckpt")]
    assert modes[0] == modes[1] == 0o666 & ~umask
    # An overwrite keeps the file's mode, as a plain save over it would.
    (tmp_path / "atomic.ckpt").chmod(0o640)
    AtomicCheckpointIO().save_checkpoint({"w": 2}, tmp_path / "atomic.ckpt")
    assert stat.S_IMODE((tmp_path / "atomic.ckpt").stat().st_mode) == 0o640


def test_disk_full_mid_write_stops_the_run_with_one_line_and_keeps_last_ckpt(
    make_cfg, tmp_path, monkeypatch, capsys
):
    real_save = torch.save

    def disk_fills_up_after_epoch_0(obj, f, *args, **kwargs):
        if obj["epoch"] == 0 or not isinstance(f, io.BufferedWriter):  # (a count, not a file)
            return real_save(obj, f, *args, **kwargs)
        part = io.BytesIO()
        real_save(obj, part)
        f.write(part.getvalue()[: len(part.getvalue()) // 2])
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:  # torch's zip writer then fails to close the archive, as torch.save does
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")  # noqa: B904

    monkeypatch.setattr(torch, "save", disk_fills_up_after_epoch_0)
    # last.ckpt only (no best-checkpoint writes), at each epoch end
    cfg = make_cfg(
        "trainer.max_epochs=2", "data.batch_size=60", "~callbacks.model_checkpoint", "test=false"
    )
    err = one_line_error(capsys, lambda: train(cfg))
    monkeypatch.undo()
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert re.fullmatch(failed_write(last, f"resume with ckpt_path={last} once there is room"), err)
    assert torch.load(last, weights_only=False)["epoch"] == 0  # intact, from epoch 0
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]  # and no temp file
    needed = re.search(r"free there, ([\d.]+) kB needed", err)[1]  # epoch 1's checkpoint
    assert float(needed) * 1000 == pytest.approx(last.stat().st_size, rel=0.01)


def test_a_full_disk_at_the_csv_log_keeps_its_last_whole_version(
    make_cfg, tmp_path, full_disk, capsys
):
    full_disk("metrics.csv", after=1)  # its first save (after step 4) fits, the next does not
    log = ("logger=csv", "trainer.log_every_n_steps=1", "+logger.csv.flush_logs_every_n_steps=4")
    err = one_line_error(capsys, lambda: train(make_cfg(*EXACT, *log)))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert re.fullmatch(
        failed_write(tmp_path / "metrics.csv", f"resume with ckpt_path={last} once there is room"),
        err,
    )
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert {row["step"] for row in csv.DictReader(f)} == {"0", "1", "2", "3"}
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_csv_log_written_whole_is_the_file_lightning_writes(tmp_path):
    steps = [{"a": 1.0}, {"a": 2.0, "b": 0.5}, {"c": 3.0}]  # a new column at each save
    for cls in (CSVLogger, AtomicCSVLogger):
        logger = cls(tmp_path / cls.__name__, name="", version="", flush_logs_every_n_steps=1)
        for step, values in enumerate(steps):
            logger.log_metrics(values, step=step)
        logger.finalize("success")
    made = [
        (tmp_path / c.__name__ / "metrics.csv").read_bytes() for c in (CSVLogger, AtomicCSVLogger)
    ]
    assert made[0] == made[1] and made[0].count(b"\n") == 4


@pytest.mark.slow
def test_a_full_filesystem_stops_the_run_in_one_line_and_keeps_the_last_good_checkpoint(
    tmp_path, tiny_data
):
    """A real 800 kB filesystem (tmpfs, in a mount namespace of its own): the shrunk run's
    checkpoints are about 290 kB, so epoch 0's two fit and epoch 1's best does not."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare here to mount a small filesystem")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    train_py = [sys.executable, str(REPO / "train.py"), *SHRINK, "trainer.max_epochs=2"]
    train_py += [f"data.data_dir={tiny_data}", f"hydra.run.dir={mnt / 'run'}"]
    script = (
        f"mount -t tmpfs -o size=800k tmpfs {mnt} || exit 99\n"
        f"{shlex.join(train_py)} 2> {out / 'err.txt'}\n"
        f"echo $? > {out / 'rc'}; cp -a {mnt / 'run'} {out}"
    )
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    done = subprocess.run([*unshare, "sh", "-c", script], env=ENV, capture_output=True, text=True)
    if done.returncode:  # no mount namespace or no tmpfs for this user: nothing was run
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.strip()[-300:]}")
    err = (out / "err.txt").read_text()
    assert (out / "rc").read_text().strip() == "2" and "Traceback" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    # The paths as the run saw them (in the namespace); the files, copied out of it.
    last = mnt / "run" / "checkpoints" / "last.ckpt"
    assert re.fullmatch(
        failed_write(
            last.with_name("best-epoch001.ckpt"), f"resume with ckpt_path={last} once there is room"
        ),
        errors[0],
    )
    kept = out / "run" / "checkpoints"
    assert sorted(p.name for p in kept.iterdir()) == ["best-epoch000.ckpt", "last.ckpt"]
    assert torch.load(kept / "last.ckpt", weights_only=False)["epoch"] == 0


def test_stray_temp_files_are_removed_before_the_first_write_in_a_folder(tmp_path, caplog):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    stray = [ckpts / ".last.ckpt.0123456789abcdef.tmp", ckpts / ".last.ckpt.k3_x9qa1.tmp"]
    kept = [ckpts / ".notes.tmp", tmp_path / "draft.ckpt.tmp"]
    for p in stray + kept:
        p.write_bytes(b"x")
    AtomicCheckpointIO().save_checkpoint({"w": 1}, ckpts / "last.ckpt")
    assert [p for p in stray + kept if p.exists()] == kept
    assert f"Removed {stray[0]}, left by a checkpoint write that was killed" in caplog.text


def test_local_path_rule():
    assert compat.is_local_path("/runs/a/last.ckpt")
    assert compat.is_local_path("file:///a.ckpt")
    assert not compat.is_local_path("s3://bucket/last.ckpt")


def test_sigterm_flag_is_the_one_the_trainer_reads():
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    compat.set_received_sigterm(trainer, True)
    assert trainer.received_sigterm
    compat.set_received_sigterm(trainer, False)
    assert not trainer.received_sigterm


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_says_how_to_resume_and_resumes_exactly(
    tiny_data, tmp_path, reference_run, signum
):
    proc, err = _start_and_signal(tiny_data, tmp_path, signum)
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in err
    line = next(ln for ln in err.splitlines() if "Resume with: " in ln)
    assert line.startswith(f"{signum.name}: stopped at epoch ")
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"saved {last}" in line
    command = shlex.split(line.split("Resume with: ", 1)[1])
    assert command[0] == "python" and f"ckpt_path={last}" in command
    subprocess.run(
        [sys.executable, *command[1:]], check=True, env=ENV, capture_output=True, cwd=REPO
    )
    assert_same_weights(reference_run, tmp_path)
    assert comparable(reference_run) == comparable(tmp_path)


class SigtermDuringValidation(L.Callback):
    """Sends this process SIGTERM in the middle of the first validation."""

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ):
        if batch_idx == 0 and not trainer.sanity_checking and trainer.current_epoch == 0:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_during_validation_stops_after_it_and_resumes_exactly(make_cfg, tmp_path):
    common = (*EXACT, "trainer.max_epochs=2", "data.eval_batch_size=8")  # 3 validation batches
    train(make_cfg(*common, f"run_dir={tmp_path / 'a'}"))
    stopped = tmp_path / "b"
    sig = f"+callbacks.sig._target_={__name__}.SigtermDuringValidation"
    with pytest.raises(SystemExit) as e:
        train(make_cfg(*common, sig, f"run_dir={stopped}"))
    assert e.value.code == 128 + signal.SIGTERM
    last = stopped / "checkpoints" / "last.ckpt"
    val = torch.load(last, weights_only=False)["loops"]["fit_loop"][
        "epoch_loop.val_loop.batch_progress"
    ]
    assert val["current"]["completed"] == 3  # saved after the whole validation, not inside it
    train(make_cfg(*common, f"run_dir={stopped}", f"ckpt_path={last}"))
    assert_same_weights(tmp_path / "a", stopped)
    assert comparable(tmp_path / "a") == comparable(stopped)


class SignalAtBatch(L.Callback):
    """Sends this process `signum` as its `batch`-th training batch (from 1) starts."""

    def __init__(self, batch: int, signum: int = signal.SIGTERM) -> None:
        self.batch, self.signum, self.seen = batch, signum, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen += 1
        if self.seen == self.batch:
            os.kill(os.getpid(), self.signum)


def signal_at(batch: int) -> tuple[str, ...]:
    return (f"+callbacks.sig._target_={__name__}.SignalAtBatch", f"+callbacks.sig.batch={batch}")


# 11 training batches an epoch: with 3 a window, steps end at batches 3, 6, 9 and 11 (Lightning
# steps on an epoch's last batch, whatever its window holds); 3 validation batches of 8. Mixup
# and cutmix on (one of the two per batch): their draws must resume exactly too.
ACCUMULATE = (
    *EXACT,
    "trainer.accumulate_grad_batches=3",
    "trainer.max_epochs=2",
    "data.eval_batch_size=8",
    "data.augment.mixup_alpha=0.4",
    "data.augment.cutmix_alpha=1.0",
)


@pytest.fixture(scope="module")
def accumulated(tiny_data, tmp_path_factory):
    """The run of ACCUMULATE, never interrupted."""
    run_dir = tmp_path_factory.mktemp("accumulated")
    train(
        compose_cfg(
            "train", (*SHRINK, f"data.data_dir={tiny_data}", *ACCUMULATE, f"run_dir={run_dir}")
        )
    )
    return run_dir


def resumed_like(reference, make_cfg, run_dir, last) -> dict:
    """Resume ACCUMULATE from `last` into `run_dir`, compare with `reference`; `last` as saved."""
    saved = torch.load(last, weights_only=False)
    train(make_cfg(*ACCUMULATE, f"run_dir={run_dir}", f"ckpt_path={last}"))
    assert_same_weights(reference, run_dir)
    assert comparable(reference) == comparable(run_dir)
    return saved


def stopped_at(make_cfg, run_dir, batch: int):
    """Run ACCUMULATE, sent SIGTERM as training batch `batch` starts; its last.ckpt."""
    with pytest.raises(SystemExit) as e:
        train(make_cfg(*ACCUMULATE, *signal_at(batch), f"run_dir={run_dir}"))
    assert e.value.code == 128 + signal.SIGTERM
    return run_dir / "checkpoints" / "last.ckpt"


def test_a_signal_mid_window_finishes_the_window_then_resumes_exactly(
    make_cfg, tmp_path, accumulated
):
    saved = resumed_like(accumulated, make_cfg, tmp_path, stopped_at(make_cfg, tmp_path, 5))
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
    assert (saved["global_step"], batches) == (2, 6)  # batch 6 ended the window 5 was in


def test_a_signal_in_the_runs_last_window_resumes_to_the_uninterrupted_runs_metrics(
    make_cfg, tmp_path, accumulated
):
    """Batch 22 is the run's last: the run stops after the last validation, and the resume
    has nothing left to train or validate; its metrics.json still holds train/* and val/*, as
    logged before the stop (they were missing: found by bench.kill_campaign)."""
    saved = resumed_like(accumulated, make_cfg, tmp_path, stopped_at(make_cfg, tmp_path, 22))
    assert (saved["epoch"], saved["global_step"]) == (2, 8)  # both epochs ended
    result = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics.VAL_ACC in result and metrics.TRAIN_LOSS in result


@pytest.mark.slow
def test_a_signal_before_a_validation_stops_after_it_then_resumes_exactly(
    make_cfg, tmp_path, accumulated
):
    # Batch 11 ends epoch 0, then its validation runs (Lightning alone would stop after its
    # first batch, and a resume cannot finish a half-run validation exactly).
    saved = resumed_like(accumulated, make_cfg, tmp_path, stopped_at(make_cfg, tmp_path, 11))
    loops = saved["loops"]["fit_loop"]
    assert loops["epoch_loop.val_loop.batch_progress"]["current"]["completed"] == 3
    assert (saved["epoch"], saved["global_step"]) == (1, 4)  # after epoch 0's end


@pytest.mark.slow
def test_a_step_checkpoint_under_accumulation_resumes_exactly(make_cfg, tmp_path, accumulated):
    """ModelCheckpoint's every_n_train_steps saves at the batch that steps: a window's end."""
    crash = ("+callbacks.crash._target_=test_resume.CrashAt", "+callbacks.crash.step=7")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(*ACCUMULATE, *crash))
    saved = resumed_like(accumulated, make_cfg, tmp_path, tmp_path / "checkpoints" / "last.ckpt")
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"]
    assert (saved["epoch"], saved["global_step"], batches) == (1, 6, 6)  # batch 6 of epoch 1


GUARD = (
    "callbacks.non_finite.patience=3",
    "callbacks.non_finite.check_every=2",
    "callbacks.step_checkpoint.every_n_train_steps=2",
)


class PoisonInputs(L.Callback):
    """Feeds inf images from optimizer step `start` on, for `steps` steps: the loss is NaN."""

    def __init__(self, start: int, steps: int = 10**9) -> None:
        self.start, self.steps = start, steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.start <= trainer.global_step < self.start + self.steps:
            batch[0].fill_(float("inf"))


def poison(start: int, steps: int = 10**9) -> tuple[str, ...]:
    return (
        f"+callbacks.poison._target_={__name__}.PoisonInputs",
        f"+callbacks.poison.start={start}",
        f"+callbacks.poison.steps={steps}",
    )


def finite_weights(path) -> bool:
    ckpt = torch.load(path, weights_only=False)
    net = {
        k: v
        for k, v in ckpt["state_dict"].items()
        if k.startswith("net.") and v.is_floating_point()
    }
    return bool(net) and all(torch.isfinite(v).all() for v in net.values())


# Epoch 0 is steps 1-11; inputs turn inf at step 14. 32-true: NaN gradients reach the weights,
# so the step-14 checkpoint is refused; 16-mixed: the GradScaler skips those steps, the weights
# stay finite and step 14 is saved.
@pytest.mark.parametrize("precision, last_step", [("32-true", 12), ("16-mixed", 14)])
def test_persistent_nan_loss_stops_and_keeps_last_good_checkpoint(
    make_cfg, tmp_path, precision, last_step, caplog
):
    with pytest.raises(
        NonFiniteLossError, match=r"non-finite for \d+ consecutive steps|weights became non-finite"
    ) as e:
        train(make_cfg(*GUARD, *poison(start=13), f"precision={precision}", "trainer.max_epochs=2"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"the last good checkpoint is {last}" in str(e.value)
    assert finite_weights(last) and torch.load(last, weights_only=False)["global_step"] == last_step
    assert (
        "non-finite training loss at step 14" in caplog.text
    )  # steps count from 1 after the update
    assert [p.name for p in tmp_path.glob("checkpoints/best-*.ckpt")] == ["best-epoch000.ckpt"]
    assert finite_weights(tmp_path / "checkpoints" / "best-epoch000.ckpt")


def test_a_short_burst_under_16_mixed_is_reported_but_not_fatal(make_cfg, caplog):
    result = train(make_cfg(*GUARD, *poison(start=5, steps=2), "precision=16-mixed"))
    assert "non-finite training loss at step 6" in caplog.text
    assert result["test/acc"] >= 0


def test_anomaly_names_the_backward_op_and_checks_the_loss_every_step(make_cfg, tmp_path):
    with pytest.raises(RuntimeError, match="returned nan values"):
        train(make_cfg("debug=anomaly", *poison(start=3), f"run_dir={tmp_path / 'a'}"))
    # Without anomaly detection, the preset's every-step check stops at the first bad loss.
    with pytest.raises(NonFiniteLossError, match="non-finite for 1 consecutive steps up to step 4"):
        train(
            make_cfg(
                "debug=anomaly",
                "trainer.detect_anomaly=false",
                *poison(start=3),
                f"run_dir={tmp_path / 'b'}",
            )
        )


def test_the_printed_resume_command_drops_what_starts_a_run_from_other_weights(tmp_path):
    """SIGTERM/Ctrl+C print how to resume: with ckpt_path, which refuses init_from."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from conftest import compose_cfg

    cfg = compose_cfg("train", ["seed=3"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.overrides.task.append("init_from=a.ckpt")  # as the fine-tuning extra's key
    HydraConfig.instance().set_config(cfg)
    try:
        command = reliability.resume_command(tmp_path / "last.ckpt", str(tmp_path))
    finally:
        HydraConfig.instance().cfg = None
    assert "seed=3" in command and f"ckpt_path={tmp_path / 'last.ckpt'}" in command
    assert "init_from" not in command


def test_a_check_every_step_reads_only_its_own_host_copy(make_cfg, monkeypatch):
    """The non-finite check's reads are of the counts it copied without waiting."""
    from test_host_sync import _watch, unexplained

    own = {
        (
            "cifar_amp/extras/reliability/reliability.py",
            "values",
        ): "StopOnNonFiniteLoss's own host copy, once it "
        "has arrived (on CUDA a pinned buffer filled without waiting, read once its event fires)"
    }
    every = ("trainer.max_epochs=1", "callbacks.non_finite.check_every=1")
    watch = _watch(make_cfg, monkeypatch, *every)
    assert watch.found and not unexplained(watch.found, own)
