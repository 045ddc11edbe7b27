"""Batch-wise augmentation as tensor ops on the training device.

Why not torchvision transforms in DataLoader workers: per-sample PIL work on CPU workers is
the bottleneck of small-image training (see `python -m bench.loader_speed`); here a whole
batch is augmented with a few kernels, and each image still gets its own random draw.

Random draws are made up front for a whole epoch (:func:`draw`) from a generator seeded by
(seed, epoch), so an epoch's augmentation is a pure function of those two numbers: the same on
any number of ranks, and exactly reproducible after a resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cifar_amp.errors import InvalidArgument


@dataclass
class Augment:
    """What the training batches get, each image with its own random draw."""

    flip: bool = True  # random horizontal flip, per image
    alternate_flip: bool = False  # flip each image in alternate epochs instead of at random
    translate: int = 4  # random shift of up to N pixels (reflect-padded crop); 0 = off
    cutout: int = 0  # side of a random zeroed square per image; 0 = off

    def __post_init__(self) -> None:
        if not 0 <= self.translate <= 16:
            raise InvalidArgument("augment.translate", self.translate, "must be in [0, 16]")
        if not 0 <= self.cutout <= 32:
            raise InvalidArgument("augment.cutout", self.cutout, "must be in [0, 32]")


@dataclass
class Draw:
    """Per-image random choices for one epoch, indexed by dataset position."""

    flip: Tensor  # (N,) bool
    shift: Tensor  # (N, 2) int, (dy, dx) in [-translate, translate]
    cutout: Tensor  # (N, 2) int, centre (cy, cx) in [0, 32)

    def take(self, idx: Tensor) -> "Draw":
        return Draw(self.flip[idx], self.shift[idx], self.cutout[idx])


def epoch_generator(seed: int, epoch: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + epoch)
    return g


def draw(n: int, epoch: int, seed: int, cfg, device: torch.device, size: int = 32) -> Draw:
    """Random choices for `n` images in `epoch`. `cfg` is an Augment."""
    g = epoch_generator(seed, epoch, device)
    if cfg.alternate_flip:
        # A fixed half of the images is flipped in even epochs, the other half in odd ones,
        # so every image is seen both ways every two epochs.
        base = torch.rand(n, generator=epoch_generator(seed, -1, device), device=device) < 0.5
        flip = base ^ bool(epoch % 2)
    else:
        flip = torch.rand(n, generator=g, device=device) < 0.5
    t = cfg.translate
    shift = torch.randint(-t, t + 1, (n, 2), generator=g, device=device)
    cutout = torch.randint(0, size, (n, 2), generator=g, device=device)
    return Draw(flip if cfg.flip else torch.zeros_like(flip), shift, cutout)


def cutout(x: Tensor, centre: Tensor, size: int) -> Tensor:
    """Zero a size x size square (clipped at the border) around each image's centre."""
    if size == 0:
        return x
    _, _, h, w = x.shape
    lo = centre - size // 2
    ys = torch.arange(h, device=x.device)[None, :]
    xs = torch.arange(w, device=x.device)[None, :]
    in_y = (ys >= lo[:, 0:1]) & (ys < lo[:, 0:1] + size)  # (N, H)
    in_x = (xs >= lo[:, 1:2]) & (xs < lo[:, 1:2] + size)  # (N, W)
    hole = in_y[:, None, :, None] & in_x[:, None, None, :]
    return x.masked_fill(hole, 0.0)


def _reflect(k: Tensor, n: int) -> Tensor:
    """Index into a reflect-padded axis of length n -> index into the axis (|pad| < n)."""
    k = k.abs()
    return torch.where(k >= n, 2 * (n - 1) - k, k)


def flip_translate(images_hwc: Tensor, idx: Tensor, d: Draw) -> Tensor:
    """The images `idx` of `images_hwc` (N, H, W, C), each mirrored where `d.flip` (B,) and then
    shifted by `d.shift` (B, 2) as :func:`translate` shifts it, in one gather of whole pixels:
    (B, H, W, C), same dtype.

    Why one gather on the stored uint8 pixels: flipping, padding and cropping float batches
    one op at a time reads and writes the batch several times in float32; this is the loop's
    augmentation cost cut about 6x on CPU (python -m bench.loader_speed).
    """
    _, h, w, c = images_hwc.shape
    ar_h = torch.arange(h, device=idx.device)[None, :]
    ar_w = torch.arange(w, device=idx.device)[None, :]
    rows = _reflect(ar_h + d.shift[:, 0:1], h)
    # Mirroring then shifting by dx reads column (w - 1 - j) - dx of the original image.
    flip = d.flip[:, None]
    dx = torch.where(flip, -d.shift[:, 1:2], d.shift[:, 1:2])
    cols = _reflect(torch.where(flip, (w - 1) - ar_w, ar_w) + dx, w)
    flat = (idx[:, None, None] * h + rows[:, :, None]) * w + cols[:, None, :]  # (B, H, W)
    return images_hwc.reshape(-1, c).index_select(0, flat.reshape(-1)).view(len(idx), h, w, c)
