"""Activation checkpointing of every k-th block or of whole stages: state-dict keys unchanged."""

import contextlib
import itertools
from typing import Callable, Container, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from cifar_amp import compat
from cifar_amp.errors import InvalidArgument

_STATS = ("running_mean", "running_var", "num_batches_tracked")


class Chain:
    """Layers as one block, built in forward: an nn.Sequential of them would add state-dict keys."""

    def __init__(self, *layers: Callable[[Tensor], Tensor]) -> None:
        self.layers = layers

    def __call__(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def modules(self) -> Iterator[nn.Module]:  # as nn.Module's, for the BatchNorm scratch
        return (m for layer in self.layers if isinstance(layer, nn.Module) for m in layer.modules())


@contextlib.contextmanager
def _stats_to_scratch(block: nn.Module | Chain):
    """The recompute's BatchNorm stat updates go to copies: the stats would move twice a step."""
    bns = [m for m in block.modules() if isinstance(m, compat.BATCH_NORM) and m.track_running_stats]
    kept = [(m, k, getattr(m, k)) for m in bns for k in _STATS]
    for m, k, t in kept:
        setattr(m, k, t.clone())
    try:
        yield
    finally:
        for m, k, t in kept:
            setattr(m, k, t)


def run_blocks(blocks: Iterable[nn.Module | Chain], x: Tensor, recompute: Container[int]) -> Tensor:
    """Apply `blocks` in order; those whose index is in `recompute` are recomputed in backward."""
    for i, block in enumerate(blocks):
        if i in recompute and torch.is_grad_enabled():
            scratch = lambda b=block: (contextlib.nullcontext(), _stats_to_scratch(b))  # noqa: E731
            x = checkpoint(block, x, use_reentrant=False, context_fn=scratch)
        else:
            x = block(x)
    return x


def recomputed(stage_sizes: Sequence[int], every: int, stages: Sequence[int]) -> frozenset[int]:
    """Blocks to recompute: 0, k, 2k, ... for `every` = k > 0, else every block of `stages`."""
    n, stages = len(stage_sizes), list(stages)
    if every < 0:
        raise InvalidArgument("activation_checkpointing", every, "must be >= 0 (0 = off)")
    if any(not isinstance(s, int) or not 0 <= s < n for s in stages):
        why = f"stages are 0..{n - 1}, highest resolution first"
    elif every and stages:
        why = f"set either it or activation_checkpointing (here {every}), not both"
    elif every:
        return frozenset(range(0, sum(stage_sizes), every))
    else:
        starts = list(itertools.accumulate(stage_sizes, initial=0))
        return frozenset(i for s in stages for i in range(starts[s], starts[s + 1]))
    raise InvalidArgument("checkpoint_stages", stages, why)
