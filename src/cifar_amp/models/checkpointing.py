"""Activation (gradient) checkpointing over a model's sequence of blocks.

Models call :func:`run_blocks` in their forward instead of wrapping submodules, so the
state-dict keys (and thus checkpoints) are the same with checkpointing on or off.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _no_running_stats(block: nn.Module):
    # The recompute in backward runs each BatchNorm forward a second time; without this its
    # running statistics would be updated twice per step. Batch statistics (what the
    # gradients depend on) are unaffected.
    bns = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    for m in bns:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in bns:
            m.track_running_stats = True


def run_blocks(blocks: Iterable[nn.Module], x: Tensor, every: int) -> Tensor:
    """Apply `blocks` in order; with `every` = k > 0, recompute every k-th block's
    activations in backward instead of storing them (blocks 0, k, 2k, ...)."""
    for i, block in enumerate(blocks):
        if every > 0 and i % every == 0 and block.training and torch.is_grad_enabled():
            x = checkpoint(
                block,
                x,
                use_reentrant=False,
                context_fn=lambda b=block: (contextlib.nullcontext(), _no_running_stats(b)),
            )
        else:
            x = block(x)
    return x


def check_every(every: int) -> int:
    if every < 0:
        raise ValueError(f"activation_checkpointing must be >= 0 (0 = off, k = every k-th block), got {every}")
    return every
