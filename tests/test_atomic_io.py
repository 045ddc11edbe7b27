import pytest
import torch

from cifar_amp import build
from cifar_amp.reliability.atomic_io import AtomicCheckpointIO


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
