"""Test-time augmentation: average the logits of a few views of each test batch.

Views and weights follow the public speed-run scripts (their TTA level 1 and 2):
- ``flip``: the image and its mirror, 1/2 each.
- ``flip_shift``: those two (1/2 in all) plus, with weight 1/4 each, the pair (image, mirror)
  shifted by (-shift, -shift) and the pair shifted by (+shift, +shift), reflect-padded.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

MODES = ("none", "flip", "flip_shift")


def _flip_mean(net: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    # One forward over both views: one larger batch is cheaper than two small ones.
    return net(torch.cat([x, x.flip(-1)])).unflatten(0, (2, -1)).mean(0)


def views(x: Tensor, shift: int) -> list[Tensor]:
    """The two copies of `x` that `flip_shift` uses (before mirroring): shifted by (-shift,
    -shift) and by (+shift, +shift), filled from a reflect-padded border."""
    h, w = x.shape[-2:]
    padded = F.pad(x, (shift,) * 4, mode="reflect")
    return [padded[..., :h, :w], padded[..., 2 * shift :, 2 * shift :]]


def predict(
    net: Callable[[Tensor], Tensor], x: Tensor, mode: str = "none", shift: int = 1
) -> Tensor:
    """Logits of `net` on `x` (N, C, H, W) averaged over the views of `mode` (see above)."""
    if mode == "none":
        return net(x)
    logits = _flip_mean(net, x)
    if mode == "flip":
        return logits
    shifted = torch.stack([_flip_mean(net, v) for v in views(x, shift)]).mean(0)
    return 0.5 * logits + 0.5 * shifted
