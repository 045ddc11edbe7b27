"""Activation checkpointing must change memory, never the maths: same gradients, and
BatchNorm running statistics updated once per step, as without it."""

import copy

import pytest
import torch
from torch import nn

from cifar_amp.models import ResNet18, SmallCNN, SpeedNet
from cifar_amp.models.checkpointing import run_blocks

MODELS = {
    "small_cnn": lambda k: SmallCNN(width=8, hidden=16, activation_checkpointing=k),
    "resnet18": lambda k: ResNet18(activation_checkpointing=k),
    "speednet": lambda k: SpeedNet(widths=(16, 32, 32), stem_width=12, activation_checkpointing=k),
}


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, dict]:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, sum(saved)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("every", [1, 2])
def test_checkpointing_gives_same_grads_and_running_stats(name, every):
    torch.manual_seed(0)
    plain = MODELS[name](0).train()
    ckpt = MODELS[name](every).train()
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


def test_running_stats_moved_once():
    bn = nn.BatchNorm1d(3, momentum=0.5)
    ckpt = copy.deepcopy(bn)
    x = torch.randn(8, 3) + 2.0
    bn(x).sum().backward()
    run_blocks([ckpt], x.clone().requires_grad_(), every=1).sum().backward()
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
    for every in (0, 1):
        blocks = net()
        torch.manual_seed(123)
        run_blocks(blocks, x, every).square().sum().backward()
        grads.append([p.grad for p in blocks.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a)
