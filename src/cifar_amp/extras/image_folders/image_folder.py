"""Extra (docs/fork.md): your own images, in torchvision's ImageFolder layout,
`<data_dir>/<class>/<image>`. Nothing in the core imports this module.

For data that does not fit on the device or is not 32x32: images are decoded (the template's
one image pipeline, data/images.py) and augmented (torchvision transforms v2) in DataLoader
worker processes, cross to the device as uint8 (a quarter of float32's bytes) into pinned
memory, and are normalised (and mixed: data.augment, data/augment.py's Mixer) there. Each
training image's random crop and flip are drawn from (seed, epoch, index), so the batches are
the same for any number of workers, and a resumed run (even mid-epoch) sees the data an
uninterrupted one would.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from lightning import LightningDataModule
from lightning.fabric.utilities.seed import pl_worker_init_function
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.datasets import DatasetFolder
from torchvision.transforms import v2

from cifar_amp.data import folds as kfold
from cifar_amp.data.augment import Mixer, Mixing
from cifar_amp.data.batches import RestoresTrainLoader
from cifar_amp.errors import InvalidArgument, UserError
from cifar_amp.extras.images.images import SUFFIXES, decode, eval_transform
from cifar_amp.seams import ImageData

log = logging.getLogger(__name__)
# The usual statistics of ImageNet-pretrained networks (timm's, torchvision's), which most
# fine-tuning starts from; `data.mean`/`data.std` set your data's own.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_SIZE = 224  # image_size for images of several sizes: what ImageNet networks take
SIZE_SAMPLE = 64  # image headers read to find the images' size
LAYOUT = "one subfolder per class holding its images, torchvision's ImageFolder layout"
NO_MIXING = Mixing()


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


def scan(folder: str | None, key: str) -> DatasetFolder:
    """The class folders and image files of `folder`; a one-line error for a bad one."""
    root = Path(str(folder))
    if not root.is_dir():
        raise UserError(f"{key}={folder}: no such folder (expected {LAYOUT})")
    try:
        found = DatasetFolder(str(root), decode, SUFFIXES, allow_empty=True)
    except FileNotFoundError as e:  # torchvision: "Couldn't find any class folder"
        raise UserError(f"{key}={folder} has no class subfolders (expected {LAYOUT})") from e
    counts = np.bincount([label for _, label in found.samples], minlength=len(found.classes))
    empty = [root / c for c, n in zip(found.classes, counts, strict=True) if n == 0]
    if empty:
        more = f" (and {len(empty) - 1} more class folders)" if len(empty) > 1 else ""
        raise UserError(f"{empty[0]}: no image files ({', '.join(SUFFIXES)}){more}")
    if len(found.classes) < 2:
        raise UserError(f"{key}={folder} has one class folder; classification needs at least 2")
    return found


def check_readable(paths: list[str]) -> None:
    """Open each file's header (cheap: no decoding), so a file that is no image stops the run
    before training, by name."""
    for path in paths:
        try:
            with Image.open(path):
                pass
        except (OSError, ValueError, SyntaxError) as e:
            raise UserError(f"{path}: cannot read this image ({type(e).__name__}: {e})") from e


class Images(Dataset):
    """(uint8 image (3, H, W), label) pairs; keys are indices, or `(epoch, index)` pairs for
    augmentation drawn from (seed, epoch, index) (see EpochSampler)."""

    def __init__(self, samples: list[tuple[str, int]], transform: Callable, seed: int | None):
        self.samples, self.transform, self.seed = samples, transform, seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        epoch, i = key if isinstance(key, tuple) else (0, key)
        path, label = self.samples[i]
        image = decode(path)
        if self.seed is None:
            return self.transform(image), label
        # v2 transforms draw from torch's global generator: seed it per image, and leave the
        # caller's (the training process itself when num_workers=0) as it was.
        state = np.random.SeedSequence([self.seed % 2**32, epoch, i]).generate_state(1)[0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(state))
            return self.transform(image), label


PR_SET_PDEATHSIG = 1  # Linux prctl(2): the signal a process gets when its parent dies


class WorkerStart:
    """A DataLoader worker's start: it dies with the run that started it, then is seeded as
    Lightning seeds a worker where the run asks it to (seed_everything(workers=True)); Lightning
    adds its own seeding only to a loader that has no worker_init_fn. Without this, a run
    killed with SIGKILL left its workers running until PyTorch's watchdog saw their parent gone,
    seconds later (bench.kill_campaign on an image folder)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if int(os.environ.get("PL_SEED_WORKERS", 0)):
            pl_worker_init_function(worker_id, rank=self.rank)


class ImageFolderDataModule(RestoresTrainLoader, LightningDataModule, ImageData):
    """Images in class folders; a seeded validation split unless `val_dir` is given."""

    def __init__(
        self,
        data_dir: str,  # one subfolder per class, holding its images (jpg, png, webp, ...)
        val_dir: str | None = None,  # same layout; null = hold out `val_split` of data_dir
        test_dir: str | None = None,  # same layout; null = test on the validation images
        val_split: float = 0.1,  # fraction of data_dir held out when there is no val_dir or folds
        # k-fold cross-validation (cifar_amp/data/folds.py): data_dir in `folds` (>= 2) folds,
        # stratified by class and drawn from `seed`; fold `fold` (in [0, folds)) validates, the
        # others train; `val_split` is not used, and val_dir must be null. null = off. Both
        # or neither.
        folds: int | None = None,
        fold: int | None = None,
        # Side of the square the network sees. null = the images' own: the shorter side when
        # every sampled image has one size (at most 224), else 224.
        image_size: int | None = None,
        # Training: a random crop of at least this fraction of the image area, resized to
        # image_size (RandomResizedCrop), then a random flip. Evaluation: the shorter side
        # resized to image_size, then the centre crop.
        min_crop_scale: float = 0.25,
        flip: bool = True,
        # Mixup and cutmix of the training batches on the device, as CIFAR's (data/augment.py's
        # Mixing: mixup_alpha, cutmix_alpha); crop and flip above are this loader's own.
        augment: Mixing = NO_MIXING,
        mean: tuple[float, float, float] = IMAGENET_MEAN,  # normalisation, [0, 1] pixel units
        std: tuple[float, float, float] = IMAGENET_STD,
        batch_size: int = 64,  # per device
        eval_batch_size: int = 128,  # per device, for validation and test
        num_workers: int | None = None,  # per device; null = CPU cores / devices, at most 8
        check_images: bool = True,  # open every file's header at setup (false: huge folders)
        seed: int = 42,  # the split, the order and every augmentation draw (the config's `seed`)
        channels_last: bool = False,  # batch layout; the precision decides it (build.py)
    ) -> None:
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if value < 1:
                raise InvalidArgument(name, value, "must be >= 1")
        if not 0.0 <= val_split < 1.0:
            raise InvalidArgument("val_split", val_split, "must be in [0, 1)")
        if image_size is not None and image_size < 16:
            raise InvalidArgument("image_size", image_size, "must be >= 16")
        if not 0.0 < min_crop_scale <= 1.0:
            raise InvalidArgument("min_crop_scale", min_crop_scale, "must be in (0, 1]")
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise InvalidArgument("mean/std", f"{mean}/{std}", "3 values each, std > 0")
        if num_workers is not None and num_workers < 0:
            raise InvalidArgument("num_workers", num_workers, "must be >= 0 (or null)")
        if not (val_dir or test_dir or val_split > 0 or folds):
            raise InvalidArgument("val_split", val_split, "> 0 needed without val_dir or test_dir")
        kfold.check(folds, fold)
        if folds and val_dir:
            why = "folds split data.data_dir into training and validation images; drop one"
            raise InvalidArgument("folds", folds, f"not with data.val_dir={val_dir}: {why}")
        super().__init__()
        self.mean, self.std = tuple(mean), tuple(std)
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.num_workers, self.check_images, self.seed = num_workers, check_images, seed
        self.channels_last, self.test_dir = channels_last, test_dir
        self.folder = scan(data_dir, "data.data_dir")
        self.classes: list[str] = self.folder.classes
        self.mixer = Mixer(augment, self.num_classes, seed)
        self.samples = {"train": self.folder.samples}
        self.where = {"train": str(data_dir)}
        if val_dir:
            self.samples["val"] = self._same_classes(val_dir, "data.val_dir").samples
            self.where["val"] = str(val_dir)
        elif folds:
            self._fold(folds, fold)
        elif val_split > 0:
            self._split(val_split)
        if test_dir:
            self.samples["test"] = self._same_classes(test_dir, "data.test_dir").samples
            self.where["test"] = str(test_dir)
        elif "val" in self.samples:
            self.samples["test"] = self.samples["val"]
            self.where["test"] = "the validation images"
        self.image_size = self._size_for(image_size)
        crop = (self.image_size, self.image_size)
        train = [v2.RandomResizedCrop(crop, scale=(min_crop_scale, 1.0), antialias=True)]
        self.train_transform = v2.Compose(
            [*train, *([v2.RandomHorizontalFlip()] if flip else []), v2.PILToTensor()]
        )
        self.eval_transform = eval_transform(crop)
        self._checked: set[str] = set()
        self._norm: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _size_for(self, image_size: int | None) -> int:
        """`image_size`, or the images' own (null); a warning when it upsamples them, which
        costs compute per image and buys no detail (224 made 32x32 images 13x slower to
        train, and less accurate)."""
        paths = [p for p, _ in self.folder.samples]
        picked = paths[:: max(1, len(paths) // SIZE_SAMPLE)][:SIZE_SAMPLE]
        sizes = set()
        for path in picked:
            try:
                with Image.open(path) as im:  # the header only
                    sizes.add(im.size)
            except (OSError, ValueError, SyntaxError):
                pass  # named at setup (check_images) or by the loader
        shorter = sorted(min(s) for s in sizes) or [DEFAULT_SIZE]
        if image_size is None:
            image_size = min(shorter[0], DEFAULT_SIZE) if len(sizes) == 1 else DEFAULT_SIZE
            if len(sizes) == 1:
                w, h = next(iter(sizes))
                log.info(
                    "Data: image_size=%d, from the images (the %d sampled are all %dx%d); "
                    "data.image_size=N resizes them",
                    image_size,
                    len(picked),
                    w,
                    h,
                )
        typical = shorter[len(shorter) // 2]
        if image_size >= 1.5 * typical:
            log.warning(
                "Data: image_size=%d upsamples the images %.1fx per side (%.0fx the pixels): "
                "their median shorter side is %d px (%d sampled); data.image_size=%d trains "
                "at their size, far faster",
                image_size,
                image_size / typical,
                (image_size / typical) ** 2,
                typical,
                len(picked),
                typical,
            )
        return image_size

    def _same_classes(self, folder: str, key: str) -> DatasetFolder:
        found = scan(folder, key)
        if found.classes != self.classes:
            theirs, ours = set(found.classes), set(self.classes)
            diff = [f"lacks {sorted(ours - theirs)}"] * bool(ours - theirs)
            diff += [f"has {sorted(theirs - ours)} too"] * bool(theirs - ours)
            raise UserError(
                f"{key}={folder} {' and '.join(diff)}: its class folders must be those of "
                f"data.data_dir ({len(self.classes)} classes)"
            )
        return found

    def _split(self, val_split: float) -> None:
        samples = self.samples["train"]
        n_val = min(max(1, round(len(samples) * val_split)), len(samples) - 1)
        perm = torch.randperm(len(samples), generator=torch.Generator().manual_seed(self.seed))
        self.samples["val"] = [samples[i] for i in sorted(perm[:n_val].tolist())]
        self.samples["train"] = [samples[i] for i in sorted(perm[n_val:].tolist())]
        self.where["val"] = f"{val_split:.0%} of data.data_dir (seed {self.seed})"

    def _fold(self, folds: int, fold: int) -> None:
        samples = self.samples["train"]
        labels = torch.tensor([label for _, label in samples])
        train, val = kfold.fold_split(labels, folds, fold, self.seed, self.classes)
        self.samples["val"] = [samples[i] for i in val.tolist()]
        self.samples["train"] = [samples[i] for i in train.tolist()]
        self.where["val"] = (
            f"fold {fold} of {folds} of data.data_dir (stratified, seed {self.seed})"
        )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def class_names(self) -> list[str]:
        return list(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)

    @property
    def meta(self) -> dict:
        """What a checkpoint needs to classify new images (the predict extra's DescribesData,
        which it writes into each checkpoint): class names and preprocessing; and
        `test_images`, the folder tested on (data_dir where there is no test_dir), on which
        export verifies by default."""
        return {
            "class_names": self.class_names,
            "mean": list(self.mean),
            "std": list(self.std),
            "image_size": [self.image_size, self.image_size],
            "test_images": str(Path(self.test_dir or self.where["train"]).resolve()),
        }

    def setup(self, stage: str | None = None) -> None:
        splits = {"fit": ("train", "val"), "validate": ("val",)}.get(stage or "", ("test",))
        todo = [s for s in splits if s in self.samples and s not in self._checked]
        if self.check_images and todo:
            start = time.perf_counter()
            paths = sorted({p for s in todo for p, _ in self.samples[s]})
            check_readable(paths)
            log.info("Checked %d image files in %.1f s", len(paths), time.perf_counter() - start)
        self._checked.update(todo)
        if stage in ("fit", None):
            counts = ", ".join(f"{len(v)} {k}" for k, v in self.samples.items())
            log.info(
                "Data: %d classes from %s (%s images; val: %s; test: %s), %dx%d, %d workers",
                self.num_classes,
                self.where["train"],
                counts,
                self.where.get("val", "none"),
                self.where.get("test", "none"),
                self.image_size,
                self.image_size,
                self._workers(),
            )

    # -- loaders -----------------------------------------------------------------
    def _workers(self) -> int:
        if self.num_workers is not None:
            return self.num_workers
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        devices = self.trainer.num_devices if self.trainer is not None else 1
        return min(8, max(1, (cores or 1) // devices))

    def _loader_args(self, persistent: bool) -> dict:
        workers = self._workers()
        on_cuda = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        rank = self.trainer.global_rank if self.trainer is not None else 0
        return {
            "num_workers": workers,
            "pin_memory": on_cuda,
            "persistent_workers": persistent and workers > 0,
            "worker_init_fn": WorkerStart(rank) if workers > 0 else None,
        }

    def train_dataloader(self) -> ResumableLoader:
        t = self.trainer
        world, rank = (t.world_size, t.global_rank) if t is not None else (1, 0)
        data = Images(self.samples["train"], self.train_transform, self.seed)
        sampler = EpochSampler(data, world, rank, shuffle=True, seed=self.seed, drop_last=True)
        loader = ResumableLoader(
            data,
            batch_size=self.batch_size,
            sampler=sampler,
            # Full batches only, except that a shard smaller than one batch is one batch.
            drop_last=len(sampler) >= self.batch_size,
            **self._loader_args(persistent=True),
        )
        return self._restored(loader)

    def _eval_loader(self, split: str, persistent: bool) -> DataLoader | list:
        if split not in self.samples:
            return []
        data = Images(self.samples[split], self.eval_transform, seed=None)
        return DataLoader(data, self.eval_batch_size, **self._loader_args(persistent))

    def val_dataloader(self):
        return self._eval_loader("val", persistent=True)

    def test_dataloader(self):
        return self._eval_loader("test", persistent=False)

    # -- on the device ------------------------------------------------------------
    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        x, y = batch
        if x.device not in self._norm:
            stats = (torch.tensor(s, device=x.device) * 255 for s in (self.mean, self.std))
            self._norm[x.device] = tuple(s.view(1, 3, 1, 1) for s in stats)
        mean, std = self._norm[x.device]
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        x = x.contiguous(memory_format=fmt).float().sub_(mean).div_(std)
        return self.mixer.training_batch((x, y), self.trainer)
