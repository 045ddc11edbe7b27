"""bench/checkpoint_stall.py: both writers write the same checkpoint and are timed."""

import pytest
import torch

from bench import checkpoint_stall


@pytest.mark.slow  # 2 x 2 saves of ResNet-18's 90 MB checkpoint
def test_both_writers_are_timed_on_the_same_checkpoint(tmp_path):
    result = checkpoint_stall.main(["--saves", "1", "--dir", str(tmp_path)])
    assert result["checkpoint_mb"] > 80  # 11.2 M weights and as many momentum values, float32
    assert set(result["median_ms"]) == {"sync", "background", "background_landed"}
    assert result["median_ms"]["background_landed"] >= result["median_ms"]["background"]
    assert not list(tmp_path.iterdir())  # its temporary folder is gone


def test_the_checkpoint_holds_the_momentum_of_a_step():
    ckpt = checkpoint_stall.checkpoint("cpu")
    state = ckpt["optimizer_states"][0]["state"]
    assert len(state) == len(ckpt["state_dict"]) - 3 * 20  # BatchNorm: 3 buffers each, no grad
    assert all(torch.count_nonzero(s["momentum_buffer"]) for s in state.values())
