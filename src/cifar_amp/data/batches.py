"""Batches drawn from tensors that already live on the training device, and the loader
position that a DataModule checkpoints for an exact mid-epoch resume.

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

    Training order and augmentation are functions of (seed, epoch) only; each of `world_size`
    ranks takes every `world_size`-th sample of the epoch's order, so the ranks together see
    every sample once (up to `world_size - 1` dropped for even shards).
    """

    # Lightning calls `dataloader.sampler.set_epoch(epoch)` at each epoch start (as for a
    # DistributedSampler), with its own restored epoch after a resume; it looks for
    # `batch_sampler` beside `sampler`.
    batch_sampler = None

    def __init__(
        self,
        images: Tensor,  # (N, 3, H, W) uint8, on the target device
        labels: Tensor,  # (N,) int64
        batch_size: int,
        mean: Tensor,  # (3,) float, in [0, 1] pixel units
        std: Tensor,
        *,
        train: bool,
        augment_cfg: augment.Augment | None = None,  # training only
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        channels_last: bool = False,
        shuffle: bool = True,  # training order; False: the same batches every epoch (overfitting)
    ) -> None:
        self.images, self.labels, self.batch_size = images, labels, batch_size
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

    @property
    def sampler(self) -> DeviceBatches:
        return self

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _shard(self) -> Tensor:
        n, dev = len(self.labels), self.labels.device
        if self.train and self.shuffle:
            g = augment.epoch_generator(self.seed, self.epoch, dev)
            order = torch.randperm(n, generator=g, device=dev)
            order = order[: n - n % self.world_size]  # equal shards keep DDP ranks in step
        else:
            order = torch.arange(n, device=dev)
        return order[self.rank :: self.world_size]

    def __len__(self) -> int:
        n = len(self.labels)
        if self.train:  # full batches, except that a shard smaller than one batch is one batch
            per_rank = n // self.world_size
            return max(1, per_rank // self.batch_size) if per_rank else 0
        return -(-len(range(self.rank, n, self.world_size)) // self.batch_size)

    def _batch(self, idx: Tensor, draw: augment.Draw | None) -> tuple[Tensor, Tensor]:
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if draw is None:
            x = self.images[idx].contiguous(memory_format=fmt).float()
            return x.sub_(self.mean).div_(self.std), self.labels[idx]
        d = draw.take(idx)
        # The gather is NHWC, i.e. already channels_last: laid out once, in the format wanted.
        x8 = augment.flip_translate(self.images_hwc, idx, d).permute(0, 3, 1, 2)
        x = x8.contiguous(memory_format=fmt).float().sub_(self.mean).div_(self.std)
        # Cutout after normalising, so the hole is the mean.
        return augment.cutout(x, d.cutout, self.augment_cfg.cutout), self.labels[idx]

    def __iter__(self):
        shard, draw = self._shard(), None
        if self.train and self.augment_cfg is not None:
            draw = augment.draw(
                len(self.labels), self.epoch, self.seed, self.augment_cfg, shard.device
            )
        r, self._resume_at = self._resume_at, None
        resumed = (
            self.train and r is not None and (r["epoch"], r["seed"]) == (self.epoch, self.seed)
        )
        start = self.position = r["position"] if resumed else 0
        for b in range(start, len(self)):
            self.position = b + 1
            yield self._batch(shard[b * self.batch_size : (b + 1) * self.batch_size], draw)

    # Lightning's fit loop saves `state_dict()` under "combined_loader" in every checkpoint and,
    # resuming an unfinished epoch, calls `load_state_dict()` before iterating. `position`
    # counts the batches the training loop took: Lightning does not prefetch from a loader with
    # a length (loops/fetchers.py), so it equals the loop's batch progress at save time.
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state


class RestoresTrainLoader:
    """For a LightningDataModule (listed before it in the bases) whose training loader has
    `state_dict`/`load_state_dict`: the loader's position also travels in the datamodule's
    checkpoint state. Lightning restores that before the loader is built, whereas the fit
    loop's own "combined_loader" restore is skipped when the loader was built early (a
    one-cycle schedule's `trainer.estimated_stepping_batches` builds it)."""

    _train = None  # the training loader last built
    _train_state: dict | None = None  # from a checkpoint, for the next loader built

    def _restored(self, loader):
        """`loader`, now the training loader, at the checkpoint's position if there is one."""
        self._train = loader
        if self._train_state:
            loader.load_state_dict(self._train_state)
        return loader

    def state_dict(self) -> dict:
        return {"train_loader": self._train.state_dict()} if self._train is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self._train_state = state.get("train_loader")
        if self._train is not None and self._train_state:
            self._train.load_state_dict(self._train_state)
