"""Augmentation on the training device, not PIL in loader workers; draws depend on (seed, epoch)."""

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cifar_amp.errors import InvalidArgument


@dataclass
class Augment:
    """What the training batches get, each image with its own random draw."""

    flip: bool = True  # random horizontal flip, per image
    alternate_flip: bool = False  # flip each image in alternate epochs instead of at random
    translate: int = 4  # random shift of up to N pixels (reflect-padded crop); 0 = off
    cutout: int = 0  # side of a random zeroed square per image; 0 = off
    # Each training batch mixed with itself shifted by one image, as timm and torchvision do:
    # mixup blends whole images, cutmix pastes a box of the other image; the batch's weight is
    # drawn from Beta(alpha, alpha), and the targets become class weights in the same shares.
    # 0 = off; with both on, each batch takes one of the two at even odds.
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    def __post_init__(self) -> None:
        for name, value, top in (("translate", self.translate, 16), ("cutout", self.cutout, 32)):
            if not 0 <= value <= top:
                raise InvalidArgument(f"augment.{name}", value, f"must be in [0, {top}]")
        for name in ("mixup_alpha", "cutmix_alpha"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise InvalidArgument(f"augment.{name}", value, "must be >= 0 (0 = off)")

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


class Draw(NamedTuple):
    """Per-image random choices for one epoch, indexed by dataset position."""

    flip: Tensor  # (N,) bool
    shift: Tensor  # (N, 2) int, (dy, dx) in [-translate, translate]
    cutout: Tensor  # (N, 2) int, centre (cy, cx) in [0, 32)

    def take(self, idx: Tensor) -> "Draw":
        return Draw(*(t[idx] for t in self))


def epoch_generator(seed: int, epoch: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + epoch)


def draw(n: int, epoch: int, seed: int, cfg: Augment, device: torch.device, size: int = 32) -> Draw:
    g = epoch_generator(seed, epoch, device)
    if cfg.alternate_flip:  # a fixed half flipped in even epochs, the other half in odd ones
        base = torch.rand(n, generator=epoch_generator(seed, -1, device), device=device) < 0.5
        flip = base ^ bool(epoch % 2)
    else:
        flip = torch.rand(n, generator=g, device=device) < 0.5
    shift = torch.randint(-cfg.translate, cfg.translate + 1, (n, 2), generator=g, device=device)
    return Draw(flip & cfg.flip, shift, torch.randint(0, size, (n, 2), generator=g, device=device))


def cutout(x: Tensor, centre: Tensor, size: int) -> Tensor:
    """Zero a size x size square around each image's centre (clipped): the mean, if normalised."""
    if size == 0:
        return x
    lo = centre[:, :, None] - size // 2  # (N, 2, 1): top, left
    ar = torch.arange(max(x.shape[-2:]), device=x.device)
    inside = (ar >= lo) & (ar < lo + size)  # (N, 2, max(H, W)): which rows, which columns
    hole = inside[:, 0, : x.shape[-2], None] & inside[:, 1, None, : x.shape[-1]]  # (N, H, W)
    return x.masked_fill(hole[:, None], 0.0)


def _reflect(k: Tensor, n: int) -> Tensor:  # reflect padding: an index < n past an end, mirrored
    return (n - 1) - ((n - 1) - k.abs()).abs()


def flip_translate(images_hwc: Tensor, idx: Tensor, d: Draw) -> Tensor:
    """Images `idx`, flipped and shifted (reflect): one uint8 gather, 6x cheaper on CPU than ops."""
    _, h, w, c = images_hwc.shape
    rows = _reflect(torch.arange(h, device=idx.device) + d.shift[:, :1], h)  # (B, H)
    # Mirroring then shifting by dx reads column (w - 1 - j) - dx of the original image.
    ar, dx = torch.arange(w, device=idx.device), d.shift[:, 1:]
    cols = _reflect(torch.where(d.flip[:, None], (w - 1 - ar) - dx, ar + dx), w)  # (B, W)
    flat = (idx[:, None, None] * h + rows[:, :, None]) * w + cols[:, None, :]  # (B, H, W)
    return images_hwc.reshape(-1, c).index_select(0, flat.reshape(-1)).view(len(idx), h, w, c)


class Mix(NamedTuple):
    """One batch's mix: cutmix or mixup, and the share of the batch's own images."""

    cutmix: bool
    share: float  # of each image itself; the rest is the image before it in the batch
    box: tuple[int, int, int, int]  # cutmix's pasted box: top, bottom, left, right


def mix_draws(batches: int, epoch: int, seed: int, rank: int, cfg: Augment, size: int = 32):
    """Each batch's Mix for one epoch of `batches` batches, drawn on the host (a few numbers a
    batch, read by the step without waiting for the device) and keyed like the flips."""
    rng = np.random.default_rng([seed % 2**32, epoch, rank])
    both = cfg.mixup_alpha > 0 and cfg.cutmix_alpha > 0
    cutmix = rng.random(batches) < 0.5 if both else np.full(batches, cfg.cutmix_alpha > 0)
    alpha = np.where(cutmix, cfg.cutmix_alpha, cfg.mixup_alpha)
    shares = rng.beta(alpha, alpha)
    centres = rng.integers(0, size, (batches, 2))
    out = []
    for cut, share, (cy, cx) in zip(
        cutmix.tolist(), shares.tolist(), centres.tolist(), strict=True
    ):
        if not cut:
            out.append(Mix(False, share, (0, 0, 0, 0)))
            continue
        half = int(size * math.sqrt(1 - share)) // 2  # a box of 1 - share of the image, clipped
        box = (max(cy - half, 0), min(cy + half, size), max(cx - half, 0), min(cx + half, size))
        pasted = (box[1] - box[0]) * (box[3] - box[2]) / size**2
        out.append(Mix(True, 1 - pasted, box))  # the share that the clipped box leaves
    return out


def mix(x: Tensor, labels: Tensor, num_classes: int, m: Mix) -> tuple[Tensor, Tensor]:
    """Batch `x` mixed by `m` with itself shifted by one image, and its class weights (N, C)."""
    weights = F.one_hot(labels, num_classes).float()
    other_x, other_weights = x.roll(1, 0), weights.roll(1, 0)
    if m.cutmix:
        top, bottom, left, right = m.box
        x[..., top:bottom, left:right] = other_x[..., top:bottom, left:right]
    else:
        x = x.mul_(m.share).add_(other_x, alpha=1 - m.share)
    return x, weights.mul_(m.share).add_(other_weights, alpha=1 - m.share)
