"""Global pooling that a deterministic run on a GPU can differentiate."""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn


class GlobalPool(nn.Module):
    """(N, C, H, W) -> (N, C, 1, 1) by `adaptive` (an nn.AdaptiveMaxPool2d(1) or
    AdaptiveAvgPool2d(1)), except in a deterministic run on a GPU: their CUDA backward has no
    deterministic kernel, and trainer.deterministic=true stopped SpeedNet's first step on one
    H200 (torch 2.11). There `reduce` over H and W stands in (torch.amax, torch.mean): the same
    values; a max's tied positions share its gradient instead of one taking it all. Elsewhere
    as before, so that no result moves (the default recipe's on CPU)."""

    def __init__(self, adaptive: nn.Module, reduce) -> None:
        super().__init__()
        self.adaptive = adaptive
        self.reduce = functools.partial(reduce, dim=(2, 3), keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda and torch.are_deterministic_algorithms_enabled():
            return self.reduce(x)
        return self.adaptive(x)
