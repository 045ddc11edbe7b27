"""Batches indexed from tensors on the training device (no host collation), resumable exactly."""

import torch
from torch import Tensor

from cifar_amp.data import augment


class DeviceBatches:
    """(normalised float32 NCHW, int64 labels); rank r of n takes every n-th of an epoch's order."""

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
        num_classes: int = 0,  # for the class weights of mixed batches (augment_cfg's mixup)
    ) -> None:
        self.images, self.labels, self.batch_size = images, labels, batch_size
        self.mean, self.std = ((t * 255).to(images.device).view(1, -1, 1, 1) for t in (mean, std))
        self.train, self.augment_cfg, self.seed = train, augment_cfg, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        mixes = train and augment_cfg is not None and augment_cfg.mixes
        self.mixer = augment.Mixer(augment_cfg, num_classes, seed) if mixes else None
        self.layout = torch.channels_last if channels_last else torch.contiguous_format
        self.images_hwc = images.permute(0, 2, 3, 1).contiguous() if train and augment_cfg else None
        # Lightning calls `sampler.set_epoch` as a DistributedSampler's, and reads `batch_sampler`.
        self.sampler, self.batch_sampler = self, None
        self.epoch = self.position = 0  # the epoch; batches handed out so far in it
        self._resume_at: dict | None = None  # from load_state_dict, for the next __iter__

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.train:  # full batches, except that a shard smaller than one batch is one batch
            per_rank = len(self.labels) // self.world_size
            return min(per_rank, max(1, per_rank // self.batch_size))
        return -(-len(range(self.rank, len(self.labels), self.world_size)) // self.batch_size)

    def __iter__(self):
        n, dev = len(self.labels), self.labels.device
        order = torch.arange(n, device=dev)
        if self.train and self.shuffle:  # equal shards keep DDP ranks in step
            g = augment.epoch_generator(self.seed, self.epoch, dev)
            order = torch.randperm(n, generator=g, device=dev)[: n - n % self.world_size]
        shard, draw = order[self.rank :: self.world_size], None
        if self.images_hwc is not None:
            draw = augment.draw(n, self.epoch, self.seed, self.augment_cfg, dev)
        r, self._resume_at = self._resume_at, None
        resumed = self.train and r and (r["epoch"], r["seed"]) == (self.epoch, self.seed)
        self.position = r["position"] if resumed else 0
        for b in range(self.position, len(self)):
            self.position = b + 1
            idx = shard[b * self.batch_size : (b + 1) * self.batch_size]
            x, y = self._batch(idx, draw)
            if self.mixer is not None:
                x, y = self.mixer.mix(x, y, self.epoch, self.rank, b, len(self))
            yield x, y

    def _batch(self, idx: Tensor, draw: augment.Draw | None) -> tuple[Tensor, Tensor]:
        if draw is None:
            x = self.images[idx].contiguous(memory_format=self.layout).float()
            return x.sub_(self.mean).div_(self.std), self.labels[idx]
        d = draw.take(idx)  # one gather of whole pixels from the NHWC copy, channels_last already
        x = augment.flip_translate(self.images_hwc, idx, d).permute(0, 3, 1, 2)
        x = x.contiguous(memory_format=self.layout).float().sub_(self.mean).div_(self.std)
        return augment.cutout(x, d.cutout, self.augment_cfg.cutout), self.labels[idx]

    # Saved in each checkpoint: Lightning prefetches no sized loader, so `position` is what trained.
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state


class RestoresTrainLoader:
    """DataModule mixin (first base) checkpointing its train loader, which Lightning may skip."""

    _train = None  # the training loader last built
    _train_state: dict | None = None  # from a checkpoint, for the next loader built

    def _restored(self, loader):
        self._train = loader
        self.load_state_dict({"train_loader": self._train_state})
        return loader

    def state_dict(self) -> dict:
        return {"train_loader": self._train.state_dict()} if self._train is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self._train_state = state.get("train_loader")
        if self._train is not None and self._train_state:
            self._train.load_state_dict(self._train_state)
