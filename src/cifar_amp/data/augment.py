"""Augmentation on the training device, not PIL in loader workers; draws depend on (seed, epoch)."""

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cifar_amp.errors import InvalidArgument, UserError


@dataclass
class Mixing:
    """Mixup and cutmix of the training batches: the options of any DataModule that mixes (its
    `augment` argument, `data.augment.*`), applied by a :class:`Mixer`."""

    # Each training batch mixed with itself shifted by one image, as timm and torchvision do:
    # mixup blends whole images, cutmix pastes a box of the other image; the batch's weight is
    # drawn from Beta(alpha, alpha), and the targets become class weights in the same shares.
    # 0 = off; with both on, each batch takes one of the two at even odds.
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    def __post_init__(self) -> None:
        for name in ("mixup_alpha", "cutmix_alpha"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise InvalidArgument(f"augment.{name}", value, "must be >= 0 (0 = off)")

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


@dataclass
class Augment(Mixing):
    """What the CIFAR loader's training batches get, each image with its own random draw, and
    the mixing of :class:`Mixing`."""

    flip: bool = True  # random horizontal flip, per image
    alternate_flip: bool = False  # flip each image in alternate epochs instead of at random
    translate: int = 4  # random shift of up to N pixels (reflect-padded crop); 0 = off
    cutout: int = 0  # side of a random zeroed square per image; 0 = off

    def __post_init__(self) -> None:
        for name, value, top in (("translate", self.translate, 16), ("cutout", self.cutout, 32)):
            if not 0 <= value <= top:
                raise InvalidArgument(f"augment.{name}", value, f"must be in [0, {top}]")
        super().__post_init__()


def cannot_mix(datamodule: str) -> str:
    """The one line for `data.augment` set on the DataModule class `datamodule`, which takes no
    `augment` argument."""
    name = datamodule.rpartition(".")[2]
    return (
        f"data.augment: {name} cannot mix batches (it takes no augment argument); mixup and "
        "cutmix need a DataModule that takes augment (data/augment.py's Mixing) and passes its "
        "training batches through a Mixer: docs/fork.md, Mixup and cutmix"
    )


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


def mix_draws(
    batches: int, epoch: int, seed: int, rank: int, cfg: Mixing, shape: tuple[int, int] = (32, 32)
) -> list[Mix]:
    """Each batch's Mix for one epoch of `batches` batches of images of `shape` (height, width),
    drawn on the host (a few numbers a batch, read by the step without waiting for the device)
    and keyed like the flips."""
    rng = np.random.default_rng([seed % 2**32, epoch, rank])
    both = cfg.mixup_alpha > 0 and cfg.cutmix_alpha > 0
    cutmix = rng.random(batches) < 0.5 if both else np.full(batches, cfg.cutmix_alpha > 0)
    alpha = np.where(cutmix, cfg.cutmix_alpha, cfg.mixup_alpha)
    shares = rng.beta(alpha, alpha)
    centres = rng.integers(0, shape, (batches, 2))  # for square images, as with one bound
    out = []
    for cut, share, centre in zip(cutmix.tolist(), shares.tolist(), centres.tolist(), strict=True):
        if not cut:
            out.append(Mix(False, share, (0, 0, 0, 0)))
            continue
        box = cut_box(centre, share, shape)
        pasted = (box[1] - box[0]) * (box[3] - box[2]) / (shape[0] * shape[1])
        out.append(Mix(True, 1 - pasted, box))  # the share that the clipped box leaves
    return out


def cut_box(centre: list[int], share: float, shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """A box of 1 - share of the image, around `centre`, clipped to it: top, bottom, left, right."""
    (cy, cx), (height, width) = centre, shape
    half_h = int(height * math.sqrt(1 - share)) // 2
    half_w = int(width * math.sqrt(1 - share)) // 2
    rows = (max(cy - half_h, 0), min(cy + half_h, height))
    return (*rows, max(cx - half_w, 0), min(cx + half_w, width))


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


class Mixer:
    """Mixup and cutmix of any DataModule's training batches, on their device: CIFAR's
    DeviceBatches, image folders and a DataModule of yours (docs/fork.md) all mix through it.
    A batch's mix is drawn from (seed, epoch, rank, its index in the epoch) and the epoch's
    number of batches, on the host once an epoch, so a run resumed mid-epoch mixes as the
    uninterrupted run did."""

    def __init__(self, mixing: Mixing | dict, num_classes: int, seed: int) -> None:
        # A DataModule built from a config without a schema is given `data.augment` as a dict.
        self.mixing = mixing if isinstance(mixing, Mixing) else Mixing(**mixing)
        self.num_classes, self.seed = num_classes, seed
        self.drawn: tuple = (None, [])  # the key of the epoch drawn last, and its draws

    def mix(
        self, x: Tensor, labels: Tensor, epoch: int, rank: int, batch: int, batches: int
    ) -> tuple[Tensor, Tensor]:
        """Batch `batch` of the epoch's `batches` on `rank`, mixed in place, and its class
        weights (N, C); as it is where mixing is off."""
        if not self.mixing.mixes:
            return x, labels
        key = (epoch, rank, batches, tuple(x.shape[-2:]))
        if self.drawn[0] != key:
            self.drawn = (key, mix_draws(batches, epoch, self.seed, rank, self.mixing, key[3]))
        return mix(x, labels, self.num_classes, self.drawn[1][batch])

    def training_batch(self, batch: tuple[Tensor, Tensor], trainer) -> tuple[Tensor, Tensor]:
        """`batch` mixed while `trainer` trains, else as it is: for a DataModule's
        `on_after_batch_transfer`. Its index is the trainer's count of the epoch's batches
        (the batch being transferred is not counted yet), which a resume restores."""
        if not (self.mixing.mixes and trainer is not None and trainer.training):
            return batch
        batches = trainer.num_training_batches
        if batches == math.inf:
            raise UserError(
                "data.augment: mixing draws an epoch's mixes at its start, so it needs a "
                "training loader with a length (len()); this one has none"
            )
        index = trainer.fit_loop.epoch_loop.batch_idx + 1
        return self.mix(*batch, trainer.current_epoch, trainer.global_rank, index, batches)
