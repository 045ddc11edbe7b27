"""A DataLoader that checkpoints its place in the epoch, and its sampler.

Lightning saves the state of any loader with `state_dict`/`load_state_dict` in every
checkpoint (the fit loop's "combined_loader") and loads it before iterating again; a plain
DataLoader has none, so a mid-epoch resume would start the epoch over. Why not torchdata's
StatefulDataLoader: it is one more dependency (its last release, 0.11 of 2025, predates this
torch), and with the order a function of (seed, epoch), a count of batches is all the state
there is.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, DistributedSampler


class EpochSampler(DistributedSampler):
    """torch's DistributedSampler (a seeded shuffle per epoch, one shard per rank; being one,
    Lightning injects no sampler of its own under DDP) that yields `(epoch, index)` keys, so
    that a dataset can draw each image's augmentation from (seed, epoch, index), whatever the
    worker or rank, and that can start `start` samples into its shard."""

    start = 0  # set by ResumableLoader for each pass

    def __iter__(self):
        order = list(super().__iter__())[self.start :]
        return iter([(self.epoch, i) for i in order])


class ResumableLoader(DataLoader):
    """A DataLoader over an :class:`EpochSampler` whose `position` (batches handed out this
    epoch) is its checkpoint state. Lightning does not prefetch from a loader with a length
    (loops/fetchers.py), so at a checkpoint `position` is the number of batches trained."""

    position = 0
    _resume: dict | None = None

    def __iter__(self):
        # A generator: this body runs at the first batch, after Lightning's set_epoch(), so
        # the sampler (also in worker processes, started from here) sees the right epoch.
        sampler, resume = self.sampler, self._resume
        self._resume = None
        epoch = getattr(sampler, "epoch", 0)
        same = resume is not None and (resume["epoch"], resume["seed"]) == (epoch, self._seed)
        self.position = resume["position"] if same else 0
        if isinstance(sampler, EpochSampler):  # else Lightning swapped it (overfit_batches)
            sampler.start = self.position * self.batch_size
        for batch in super().__iter__():
            self.position += 1
            yield batch

    @property
    def _seed(self) -> int | None:
        return getattr(self.sampler, "seed", None)

    def state_dict(self) -> dict:
        epoch = getattr(self.sampler, "epoch", 0)
        return {"epoch": epoch, "position": self.position, "seed": self._seed}

    def load_state_dict(self, state: dict) -> None:
        self._resume = state


class RestoresTrainLoader:
    """For a LightningDataModule (listed before it in the bases) whose training loader has
    `state_dict`/`load_state_dict`: the loader's position also travels in the datamodule's
    checkpoint state. Lightning restores that before the loader is built, whereas the fit
    loop's own "combined_loader" restore is skipped when the loader was built early (OneCycleLR's
    `trainer.estimated_stepping_batches` builds it in configure_optimizers)."""

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
