"""model=resnet18 (the resnet18 extra): activation checkpointing by block or stage keeps the
maths and frees memory where the resolution is high."""

import pytest
import torch

from cifar_amp.extras.resnet18.resnet import ResNet18
from conftest import deterministic_grads_twice, requires_cuda
from test_checkpointing import _saved_bytes, _step


@pytest.mark.parametrize("setting", [{"activation_checkpointing": 2}, {"checkpoint_stages": [1]}])
def test_checkpointing_gives_same_grads_and_running_stats(setting):
    # Stage 1 holds the downsampling block, with a BatchNorm of its own.
    torch.manual_seed(0)
    plain, ckpt = ResNet18().train(), ResNet18(**setting).train()
    ckpt.load_state_dict(plain.state_dict())
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    (ref, saved_plain), (got, saved_ckpt) = _step(plain, x, y), _step(ckpt, x, y)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)
    for (n, a), (_, b) in zip(plain.named_buffers(), ckpt.named_buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)
    assert saved_ckpt < saved_plain


def test_the_high_resolution_stages_hold_most_activations():
    # What makes the stage choice worth having: recomputing ResNet-18's first stage frees
    # more than recomputing its last two, for the same number of recomputed convolutions.
    x, y = torch.randn(1, 3, 32, 32), torch.randint(0, 10, (1,))
    saved = {}
    for stages in ((), (0,), (2, 3), (0, 1)):
        torch.manual_seed(0)
        saved[stages] = _saved_bytes(ResNet18(checkpoint_stages=stages).train(), x, y)[1]
    assert saved[(0, 1)] < saved[(0,)] < saved[(2, 3)] < saved[()]
    assert saved[(0, 1)] < 0.5 * saved[()]


def _peak_step_mb(setting: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    """Device memory a training step adds at its peak over what was allocated before it."""
    torch.manual_seed(0)
    net = ResNet18(**setting).cuda().to(memory_format=torch.channels_last).train()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - start) / 2**20
    del net, loss
    torch.cuda.empty_cache()
    return peak


@pytest.mark.gpu
@requires_cuda
def test_activation_checkpointing_lowers_peak_cuda_memory():
    x = torch.randn(512, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (512,), device="cuda")
    _peak_step_mb({}, x, y)  # warm-up: cuDNN handles, autocast kernels
    plain = _peak_step_mb({}, x, y)
    stages = _peak_step_mb({"checkpoint_stages": [0, 1]}, x, y)
    every = _peak_step_mb({"activation_checkpointing": 1}, x, y)
    late = _peak_step_mb({"checkpoint_stages": [3]}, x, y)
    # Traced on fake tensors (bench/memory.py), the two settings keep about 0.45x of the
    # activation memory; workspaces and gradients add to both sides on a real device.
    assert stages < 0.7 * plain and every < 0.7 * plain, (plain, stages, every)
    # The high-resolution stages are the ones that pay: the last one alone saves little.
    assert stages < 0.85 * plain < late <= 1.05 * plain, (plain, stages, late)


@pytest.mark.gpu
@requires_cuda
def test_resnet18_trains_deterministically_on_cuda():
    # AdaptiveAvgPool2d's CUDA backward has no deterministic kernel: trainer.deterministic=true
    # would stop at the first step (as SpeedNet's max pool did on one H200).
    first, second = deterministic_grads_twice(ResNet18())
    assert torch.equal(first, second)


def test_the_global_pool_is_the_adaptive_average_off_a_deterministic_gpu():
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    pooled = ResNet18().avgpool(x)
    assert torch.equal(pooled, torch.nn.functional.adaptive_avg_pool2d(x, 1))


def test_the_mixup_recipe_trains_shrunk(make_cfg, tmp_path):
    """experiment=resnet18_mixup (this extra's), one short epoch: mixed batches, soft targets."""
    from cifar_amp.training import train

    cfg = make_cfg(
        "experiment=resnet18_mixup",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "data.batch_size=4",
        "data.eval_batch_size=4",
    )
    assert cfg.data.augment.mixup_alpha == cfg.data.augment.cutmix_alpha == 1.0
    result = train(cfg)
    assert result["train/loss"] > 0 and 0 <= result["test/acc"] <= 1
