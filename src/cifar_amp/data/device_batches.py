"""An iterable of batches drawn from tensors that already live on the training device.

Why not torch's DataLoader: with the whole dataset on the device, a batch is one index
operation; DataLoader would fetch and collate it sample by sample on the host. Lightning
accepts any sized iterable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cifar_amp.data import augment


class DeviceBatches:
    """Yields (images, labels): images normalised float32 (N, 3, H, W), labels int64.

    Training order and augmentation are functions of (seed, epoch) only; each of
    `world_size` ranks takes every `world_size`-th sample of the epoch's order, so the
    ranks together see every sample once (up to `world_size - 1` dropped for even shards).
    """

    def __init__(
        self,
        images: Tensor,  # (N, 3, H, W) uint8, on the target device
        labels: Tensor,  # (N,) int64
        batch_size: int,
        mean: Tensor,  # (3,) float, in [0, 1] pixel units
        std: Tensor,
        *,
        train: bool,
        augment_cfg=None,  # augment.Augment; training only
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        channels_last: bool = False,
        shuffle: bool = True,  # training order; False: the same batches every epoch (overfitting)
    ) -> None:
        self.images, self.labels = images, labels
        self.batch_size = batch_size
        self.mean = (mean * 255).to(images.device).view(1, -1, 1, 1)
        self.std = (std * 255).to(images.device).view(1, -1, 1, 1)
        self.train, self.augment_cfg, self.seed = train, augment_cfg, seed
        self.rank, self.world_size = rank, world_size
        self.channels_last, self.shuffle = channels_last, shuffle
        # Training batches are gathered whole-pixel from a (N, H, W, C) copy (uint8, small).
        self.images_hwc = images.permute(0, 2, 3, 1).contiguous() if train and augment_cfg else None
        self.epoch = 0  # set by Lightning through set_epoch() before every epoch
        self.position = 0  # batches handed out so far in this epoch
        self._resume_at: dict | None = None  # from load_state_dict, for the next __iter__

    # -- order -----------------------------------------------------------------
    def _shard(self) -> Tensor:
        n, dev = len(self.labels), self.labels.device
        if self.train and self.shuffle:
            order = torch.randperm(
                n, generator=augment.epoch_generator(self.seed, self.epoch, dev), device=dev
            )
            order = order[: n - n % self.world_size]  # equal shards keep DDP ranks in step
        else:
            order = torch.arange(n, device=dev)
        return order[self.rank :: self.world_size]

    def __len__(self) -> int:
        n = len(self.labels)
        per_rank = n // self.world_size if self.train else len(range(self.rank, n, self.world_size))
        if self.train:
            return max(1, per_rank // self.batch_size) if per_rank else 0
        return -(-per_rank // self.batch_size)

    # -- batches ---------------------------------------------------------------
    def _batch(self, idx: Tensor, draw: augment.Draw | None) -> tuple[Tensor, Tensor]:
        if draw is None:
            x = self.images[idx].float().sub_(self.mean).div_(self.std)
        else:
            d = draw.take(idx)
            # The gather is NHWC, i.e. already channels_last: lay it out once, in the format wanted.
            fmt = torch.channels_last if self.channels_last else torch.contiguous_format
            x8 = augment.flip_translate(self.images_hwc, idx, d).permute(0, 3, 1, 2)
            x = x8.contiguous(memory_format=fmt).float().sub_(self.mean).div_(self.std)
            x = augment.cutout(
                x, d.cutout, self.augment_cfg.cutout
            )  # fills the mean: after normalising
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, self.labels[idx]

    def __iter__(self):
        shard = self._shard()
        draw = None
        if self.train and self.augment_cfg is not None:
            draw = augment.draw(
                len(self.labels), self.epoch, self.seed, self.augment_cfg, shard.device
            )
        start, self._resume_at = self._start(), None
        self.position = start
        # Training drops the short last batch (len() counts full batches only), except
        # that a shard smaller than one batch still yields that one batch.
        for b in range(start, len(self)):
            self.position = b + 1
            yield self._batch(shard[b * self.batch_size : (b + 1) * self.batch_size], draw)

    # -- mid-epoch resume ----------------------------------------------------------
    # Lightning's fit loop saves `state_dict()` under "combined_loader" in every checkpoint
    # and, when it resumes an unfinished epoch, calls `load_state_dict()` before iterating.
    # `position` counts batches the training loop has taken: Lightning does not prefetch from
    # a loader with a length (loops/fetchers.py), so it equals the loop's batch progress at
    # save time (tests/test_resume.py checks this).
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state

    def _start(self) -> int:
        r = self._resume_at
        if not self.train or r is None or r["epoch"] != self.epoch or r["seed"] != self.seed:
            return 0
        return r["position"]

    # -- epochs ------------------------------------------------------------------
    # Lightning calls `dataloader.sampler.set_epoch(epoch)` at each epoch start (as for a
    # DistributedSampler), with its own restored epoch count after a resume; it looks for
    # `batch_sampler` beside `sampler`.
    batch_sampler = None

    @property
    def sampler(self) -> "DeviceBatches":
        return self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
