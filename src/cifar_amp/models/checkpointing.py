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

from cifar_amp.reliability import private

_STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _running_stats_to_scratch(block: nn.Module):
    # The recompute in backward runs each BatchNorm forward a second time; its running-stat
    # update must not land (else they move twice per step). Turning tracking off for the
    # recompute is not an option: BatchNorm would then save fewer tensors than in the first
    # forward and torch.utils.checkpoint raises. So the update goes to throwaway copies.
    bns = [m for m in block.modules() if isinstance(m, private.BatchNorm) and m.track_running_stats]
    kept = [(m, {k: getattr(m, k) for k in _STATS}) for m in bns]
    for m, bufs in kept:
        for k, t in bufs.items():
            setattr(m, k, t.clone())
    try:
        yield
    finally:
        for m, bufs in kept:
            for k, t in bufs.items():
                setattr(m, k, t)


def run_blocks(blocks: Iterable[nn.Module], x: Tensor, every: int) -> Tensor:
    """Apply `blocks` in order; with `every` = k > 0, recompute every k-th block's
    activations in backward instead of storing them (blocks 0, k, 2k, ...)."""
    for i, block in enumerate(blocks):
        if every > 0 and i % every == 0 and block.training and torch.is_grad_enabled():
            x = checkpoint(
                block,
                x,
                use_reentrant=False,
                context_fn=lambda b=block: (contextlib.nullcontext(), _running_stats_to_scratch(b)),
            )
        else:
            x = block(x)
    return x


def check_every(every: int) -> int:
    if every < 0:
        raise ValueError(
            f"activation_checkpointing must be >= 0 (0 = off, k = every k-th block), got {every}"
        )
    return every
