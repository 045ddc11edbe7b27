"""Test-time augmentation, as the public speed-run scripts weigh it: ``flip`` averages the image and
its mirror; ``flip_shift`` gives that 1/2 and each (reflect-padded) +-shift pair's average 1/4."""

from abc import ABC, abstractmethod
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

TTA_MODES = ("none", "flip", "flip_shift")
Net = Callable[[Tensor], Tensor]


class TestTimeAugmented(ABC):
    """A LightningModule whose test evaluates `tta(x)`: predict and export then use it in place
    of the plain forward, and report `tta_mode` (a module that is not one is used by its forward).
    Implemented by: module.ImageClassifier."""

    @abstractmethod
    def tta(self, x: Tensor) -> Tensor: ...  # images (N, C, H, W) -> logits, as test sees them

    @property
    @abstractmethod
    def tta_mode(self) -> str: ...  # of TTA_MODES


def _flip_mean(net: Net, x: Tensor) -> Tensor:
    # One forward over both views: one larger batch is cheaper than two small ones.
    return net(torch.cat([x, x.flip(-1)])).unflatten(0, (2, -1)).mean(0)


def tta_logits(net: Net, x: Tensor, mode: str = "none", shift: int = 1) -> Tensor:
    """Logits of `net` on `x` (N, C, H, W) averaged over the views of `mode` (see above)."""
    if mode == "none":
        return net(x)
    if mode == "flip":
        return _flip_mean(net, x)
    h, w = x.shape[-2:]
    padded = F.pad(x, (shift,) * 4, mode="reflect")
    views = [padded[..., :h, :w], padded[..., 2 * shift :, 2 * shift :]]
    shifted = torch.stack([_flip_mean(net, v) for v in views]).mean(0)
    return 0.5 * _flip_mean(net, x) + 0.5 * shifted
