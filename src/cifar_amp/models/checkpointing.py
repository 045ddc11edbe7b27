"""Activation (gradient) checkpointing over a model's sequence of blocks.

Models call :func:`run_blocks` in their forward instead of wrapping submodules, so the
state-dict keys (and thus checkpoints) are the same with checkpointing on or off. Which blocks
are recomputed in backward is chosen by one of two model arguments, resolved by
:func:`recomputed`: every k-th block, or every block of chosen stages (a stage is the blocks
at one resolution, the stem counted with the first; the early, high-resolution stages hold
most of the activations for the same recompute cost as the later ones).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Container, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from cifar_amp.errors import InvalidArgument

_STATS = ("running_mean", "running_var", "num_batches_tracked")
# Private: the base of BatchNorm1d/2d/3d, SyncBatchNorm and the lazy variants, the one type that
# means "has BatchNorm running statistics" (no public base class exists).
_BATCH_NORM = nn.modules.batchnorm._BatchNorm


class Chain:
    """Layers applied in order, as one block, without registering them again: an
    nn.Sequential over a model's existing layers would add state-dict keys. Built in
    forward, so it always holds the model's current layers."""

    def __init__(self, *layers: Callable[[Tensor], Tensor]) -> None:
        self.layers = layers

    def __call__(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def modules(self) -> Iterator[nn.Module]:
        for layer in self.layers:
            if isinstance(layer, nn.Module):
                yield from layer.modules()


@contextlib.contextmanager
def _running_stats_to_scratch(block: nn.Module | Chain):
    # The recompute in backward runs each BatchNorm forward a second time; its running-stat
    # update must not land (else they move twice per step). Turning tracking off for the
    # recompute is not an option: BatchNorm would then save fewer tensors than in the first
    # forward and torch.utils.checkpoint raises. So the update goes to throwaway copies.
    bns = [m for m in block.modules() if isinstance(m, _BATCH_NORM) and m.track_running_stats]
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


def run_blocks(blocks: Iterable[nn.Module | Chain], x: Tensor, recompute: Container[int]) -> Tensor:
    """Apply `blocks` in order; the activations of the blocks whose index is in `recompute`
    are not kept for backward but recomputed there (when gradients are being recorded)."""
    for i, block in enumerate(blocks):
        if i in recompute and torch.is_grad_enabled():
            x = checkpoint(
                block,
                x,
                use_reentrant=False,
                context_fn=lambda b=block: (contextlib.nullcontext(), _running_stats_to_scratch(b)),
            )
        else:
            x = block(x)
    return x


def recomputed(stage_sizes: Sequence[int], every: int, stages: Sequence[int]) -> frozenset[int]:
    """The indices of the blocks to recompute, from a model's two arguments: `every` = k > 0
    recomputes blocks 0, k, 2k, ... (`activation_checkpointing`); `stages` recomputes every
    block of those stages (`checkpoint_stages`). `stage_sizes`: blocks per stage, in order."""
    if every < 0:
        raise InvalidArgument(
            "activation_checkpointing", every, "must be >= 0 (0 = off, k = every k-th block)"
        )
    n = len(stage_sizes)
    stages = list(stages)
    if any(not isinstance(s, int) or not 0 <= s < n for s in stages):
        raise InvalidArgument(
            "checkpoint_stages", stages, f"stages are 0..{n - 1}, highest resolution first"
        )
    if every and stages:
        raise InvalidArgument(
            "checkpoint_stages",
            stages,
            f"set either it or activation_checkpointing (every k-th block, here {every}), not both",
        )
    if every:
        return frozenset(range(0, sum(stage_sizes), every))
    starts = list(itertools.accumulate(stage_sizes, initial=0))
    return frozenset(i for s in stages for i in range(starts[s], starts[s + 1]))
