"""Activation checkpointing must change memory, never the maths: same gradients, and
BatchNorm running statistics updated once per step, as without it; and the blocks it
recomputes are the ones the model's settings name."""

import copy

import pytest
import torch
from torch import nn

from cifar_amp.compat import BATCH_NORM
from cifar_amp.errors import InvalidArgument
from cifar_amp.models.checkpointing import recomputed, run_blocks
from cifar_amp.models.small_cnn import SmallCNN
from cifar_amp.models.speednet import SpeedNet

MODELS = {
    "small_cnn": lambda **ck: SmallCNN(width=8, hidden=16, **ck),
    "speednet": lambda **ck: SpeedNet(widths=(16, 32, 32), stem_width=12, **ck),
}
# Each model with both ways of choosing blocks (model=resnet18's: tests/extras/resnet18/test_resnet.py).
CASES = [
    ("small_cnn", {"activation_checkpointing": 1}),
    ("small_cnn", {"checkpoint_stages": [1]}),
    ("speednet", {"activation_checkpointing": 1}),
    ("speednet", {"checkpoint_stages": [0]}),
]


def _saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The loss, and the bytes of the tensors its graph keeps for backward (each storage
    once, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(x), y)
    return loss, sum(saved.values())


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, int]:
    loss, saved = _saved_bytes(model, x, y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, saved


@pytest.mark.parametrize("name, setting", CASES, ids=lambda c: str(c))
def test_checkpointing_gives_same_grads_and_running_stats(name, setting):
    torch.manual_seed(0)
    plain = MODELS[name]().train()
    ckpt = MODELS[name](**setting).train()
    assert list(ckpt.state_dict()) == list(plain.state_dict())  # checkpoint files unchanged
    ckpt.load_state_dict(plain.state_dict())
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    ref, saved_plain = _step(plain, x, y)
    got, saved_ckpt = _step(ckpt, x, y)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)
    # Buffers: BatchNorm running mean/var and num_batches_tracked moved exactly once.
    for (n, a), (_, b) in zip(plain.named_buffers(), ckpt.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)
    assert saved_ckpt < saved_plain  # it did checkpoint: fewer activations kept for backward


@pytest.mark.parametrize(
    "sizes, every, stages, expected",
    [
        ((3, 2, 2, 2), 0, (), set()),
        ((3, 2, 2, 2), 1, (), set(range(9))),
        ((3, 2, 2, 2), 4, (), {0, 4, 8}),
        ((3, 2, 2, 2), 0, (0,), {0, 1, 2}),
        ((3, 2, 2, 2), 0, [1, 3], {3, 4, 7, 8}),
        ((2, 1, 1), 0, [2], {3}),
    ],
)
def test_recomputed_blocks(sizes, every, stages, expected):
    assert recomputed(sizes, every, stages) == expected


@pytest.mark.parametrize(
    "every, stages, message",
    [
        (-1, (), "activation_checkpointing: -1; must be >= 0"),
        (0, (3,), r"checkpoint_stages: \[3\]; stages are 0..2"),
        (0, (-1,), r"checkpoint_stages: \[-1\]; stages are 0..2"),
        (2, (0,), r"checkpoint_stages: \[0\]; set either it or activation_checkpointing"),
    ],
)
def test_bad_checkpointing_settings_are_refused(every, stages, message):
    with pytest.raises(InvalidArgument, match=message):
        SpeedNet(activation_checkpointing=every, checkpoint_stages=stages)


def test_running_stats_moved_once():
    bn = nn.BatchNorm1d(3, momentum=0.5)
    ckpt = copy.deepcopy(bn)
    x = torch.randn(8, 3) + 2.0
    bn(x).sum().backward()
    run_blocks([ckpt], x.clone().requires_grad_(), recompute={0}).sum().backward()
    assert int(ckpt.num_batches_tracked) == 1
    torch.testing.assert_close(ckpt.running_mean, bn.running_mean)
    torch.testing.assert_close(ckpt.running_var, bn.running_var)


def test_dropout_blocks_give_same_grads():
    # torch.utils.checkpoint restores the RNG state for the recompute, so dropout draws
    # the same mask twice.
    def net():
        torch.manual_seed(1)
        return nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.GELU()) for _ in range(3)
        ).train()

    x = torch.randn(8, 16)
    grads = []
    for recompute in (set(), {0, 1, 2}):
        blocks = net()
        torch.manual_seed(123)
        run_blocks(blocks, x, recompute).square().sum().backward()
        grads.append([p.grad for p in blocks.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a)


def test_batchnorm_base_covers_every_batchnorm_and_nothing_else():
    """A private torch name (no public base class exists): still what it was."""
    for bn in (nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm2d()):
        assert isinstance(bn, BATCH_NORM) and hasattr(bn, "running_mean")
    for other in (nn.LayerNorm(2), nn.GroupNorm(1, 2), nn.InstanceNorm2d(2)):
        assert not isinstance(other, BATCH_NORM)
