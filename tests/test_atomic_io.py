import errno
import io
import os
import stat

import pytest
import torch

from cifar_amp import build
from cifar_amp.errors import reported
from cifar_amp.reliability import run_dirs
from cifar_amp.reliability.atomic_io import AtomicCheckpointIO
from cifar_amp.training import train


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


def test_trainer_writes_checkpoints_atomically(make_cfg):
    for precision in ("32-true", "16-mixed"):  # 16-mixed brings its own plugin list
        trainer = build.trainer(make_cfg(f"precision={precision}"), callbacks=[], loggers=[])
        assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)


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
        if obj["epoch"] == 0:
            return real_save(obj, f, *args, **kwargs)
        part = io.BytesIO()
        real_save(obj, part)
        f.write(part.getvalue()[: len(part.getvalue()) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_fills_up_after_epoch_0)
    # last.ckpt only (no best-checkpoint writes), at each epoch end
    cfg = make_cfg(
        "trainer.max_epochs=2", "data.batch_size=60", "~callbacks.model_checkpoint", "test=false"
    )
    with pytest.raises(SystemExit) as e, reported():
        train(cfg)
    monkeypatch.undo()
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert (
        err == f"error: cannot write {last}: No space left on device; its previous version is kept"
    )
    assert torch.load(last, weights_only=False)["epoch"] == 0  # intact, from epoch 0
    assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]  # and no temp file


def test_stray_temp_files_are_removed_on_the_next_start_in_the_run_dir(tmp_path, caplog):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    stray = [ckpts / ".last.ckpt.0123456789abcdef.tmp", ckpts / ".last.ckpt.k3_x9qa1.tmp"]
    kept = [ckpts / "last.ckpt", ckpts / ".notes.tmp", tmp_path / "draft.ckpt.tmp"]
    for p in stray + kept:
        p.write_bytes(b"x")
    with run_dirs.claim(str(tmp_path), ckpt_path=str(ckpts / "last.ckpt")):
        pass
    assert [p for p in stray + kept if p.exists()] == kept
    assert f"Removed {stray[0]}, left by a checkpoint write that was killed" in caplog.text
