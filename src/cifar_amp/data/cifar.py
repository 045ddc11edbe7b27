"""CIFAR-10/100's python format, decoded once to uint8 on the device; downloads checksum-checked."""

import logging
import pickle
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from lightning import LightningDataModule
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.utils import download_and_extract_archive

from cifar_amp.data import folds as kfold
from cifar_amp.data.augment import Augment
from cifar_amp.data.batches import DeviceBatches, RestoresTrainLoader
from cifar_amp.errors import InvalidArgument, UserError
from cifar_amp.seams import ImageData

log = logging.getLogger(__name__)
AUGMENT = Augment()  # flip + 4-pixel translate


def read_batch(path: Path, classes: int = 0) -> tuple[np.ndarray, np.ndarray | None, str | None]:
    """(N, 3, 32, 32) uint8 images, (N,) labels (< `classes` if set, else maybe None), their key."""
    if not path.is_file():
        raise UserError(f"missing data file {path}")
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        data = np.asarray(entry["data"], dtype=np.uint8)
        key = next((k for k in ("labels", "fine_labels") if k in entry), None)
        labels = None if key is None else np.asarray(entry[key], dtype=np.int64)
    except Exception as e:
        why = f"{type(e).__name__}: {e}"
        raise UserError(f"{path} is truncated or not a CIFAR python batch file ({why})") from e
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        why = f"data has shape {data.shape}, expected (N, 3072) (3x32x32 uint8 rows)"
    elif labels is None and classes:
        why = "no labels"
    elif labels is not None and labels.shape != (len(data),):
        why = f"{len(labels)} labels for {len(data)} images"
    elif classes and len(labels) and not 0 <= labels.min() <= labels.max() < classes:
        why = f"labels span [{labels.min()}, {labels.max()}], expected [0, {classes - 1}]"
    else:
        return data.reshape(-1, 3, 32, 32), labels, key
    raise UserError(f"{path}: {why}")


class Spec(NamedTuple):
    tv: type  # the torchvision class whose url, md5, folder and file names we reuse
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    names: tuple[str, ...]  # the official label names, for folders without a names file

    @property
    def num_classes(self) -> int:
        return len(self.names)

    def class_names(self, folder: Path | None) -> list[str]:
        """The label names of `folder`'s names file (batches.meta), else the official ones."""
        names, path = list(self.names), folder and folder / self.tv.meta["filename"]
        try:
            with open(path, "rb") as f:
                found = [str(n) for n in pickle.load(f, encoding="latin1")[self.tv.meta["key"]]]
            names = found if len(found) == self.num_classes else names
        except (TypeError, FileNotFoundError):  # no folder, no names file: the official names
            pass
        except Exception as e:  # only the names are lost
            log.warning("%s is unreadable (%s); using the official class names", path, e)
        return names

    def files(self, split: str) -> list[str]:
        return [name for name, _ in getattr(self.tv, f"{split}_list")]

    def find(self, data_dir: str | Path) -> Path | None:
        """`data_dir/<folder>` or `data_dir` itself, whichever holds the first batch file."""
        for cand in (Path(data_dir) / self.tv.base_folder, Path(data_dir)):
            if any((cand / self.files(split)[0]).exists() for split in ("train", "test")):
                return cand
        return None

    def locate(self, data_dir: str | Path, download: bool) -> Path:
        """The folder in `data_dir`, downloaded there (checksum verified) if missing and allowed."""
        if (folder := self.find(data_dir)) is not None:
            return folder
        tv, why = self.tv, "data.download=false"
        if download:
            log.info("Downloading %s into %s", tv.url, data_dir)
            try:
                download_and_extract_archive(tv.url, data_dir, filename=tv.filename, md5=tv.tgz_md5)
                return Path(data_dir) / tv.base_folder
            except Exception as e:  # a URLError, a timeout or a checksum mismatch all mean no data
                why = f"the download failed ({type(e).__name__}: {e})"
        how = f"either connect to the internet (it is downloaded into {data_dir}/), or point data.data_dir at a folder that contains {tv.base_folder}/"
        raise UserError(f"no {tv.base_folder}/ found in data.data_dir={data_dir} and {why}: {how}")

    def read(self, folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [read_batch(folder / name, self.num_classes) for name in self.files(split)]
        return tuple(torch.from_numpy(np.concatenate([p[i] for p in parts])) for i in (0, 1))


CIFAR10_NAMES = "airplane automobile bird cat deer dog frog horse ship truck"
CIFAR100_NAMES = """apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy
bridge bus butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach
couch crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo
keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree motorcycle mountain mouse
mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain plate poppy
porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper snail
snake spider squirrel streetcar sunflower sweet_pepper table tank telephone television tiger
tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm"""
SPECS = {
    "cifar10": Spec(
        CIFAR10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), tuple(CIFAR10_NAMES.split())
    ),
    "cifar100": Spec(
        CIFAR100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), tuple(CIFAR100_NAMES.split())
    ),
}


class CIFARDataModule(RestoresTrainLoader, LightningDataModule, ImageData):
    """CIFAR-10/100 on the training device, with a seeded validation split of the training set."""

    def __init__(
        self,
        dataset: str = "cifar10",  # a key of SPECS
        data_dir: str = "data",  # holds cifar-10-batches-py/ (or is it); downloaded here if missing
        download: bool = True,
        batch_size: int = 512,  # per device
        eval_batch_size: int = 1024,  # per device, for validation and test
        val_split: float = 0.1,  # fraction of the training set held out, in [0, 1); see folds
        # k-fold cross-validation (data/folds.py): the training set in `folds` (>= 2) folds,
        # stratified by class and drawn from `seed`; fold `fold` (in [0, folds)) validates, the
        # others train, and `val_split` is not used. null = off. Both or neither.
        folds: int | None = None,
        fold: int | None = None,
        augment: Augment = AUGMENT,  # on the training device, see data/augment.py
        seed: int = 42,  # the split and every augmentation draw
        channels_last: bool = False,  # batch layout; the precision decides it (build.py)
    ) -> None:
        if dataset not in SPECS:
            raise InvalidArgument("dataset", repr(dataset), f"valid: {', '.join(SPECS)}")
        for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if value < 1:
                raise InvalidArgument(name, value, "must be >= 1")
        if not 0.0 <= val_split < 1.0:
            raise InvalidArgument("val_split", val_split, "must be in [0, 1)")
        kfold.check(folds, fold)
        super().__init__()
        self.spec, self.data_dir, self.download = SPECS[dataset], data_dir, download
        self.num_classes = self.spec.num_classes  # the model's output size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.val_split, self.seed, self.channels_last = val_split, seed, channels_last
        self.folds = folds
        self.fold = fold
        self.augment = Augment(**augment) if isinstance(augment, dict) else augment
        self.splits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def class_names(self) -> list[str]:
        """The label names, from the data folder's names file where it has one."""
        return self.spec.class_names(self.spec.find(self.data_dir))

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, 32, 32)

    def prepare_data(self) -> None:
        self.spec.locate(self.data_dir, self.download)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        folder = self.spec.locate(self.data_dir, download=False)
        device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
        images, labels = self.spec.read(folder, "train")
        train, val = self._held_out(labels)
        splits = {"train": (images[train], labels[train]), "val": (images[val], labels[val])}
        splits["test"] = self.spec.read(folder, "test")
        self.splits = {k: (x.to(device), y.to(device)) for k, (x, y) in splits.items()}
        sizes = ", ".join(f"{len(y)} {k}" for k, (_, y) in self.splits.items())
        log.info("Data: %s on %s: %s images%s", folder, device, sizes, self._fold_note())

    def _held_out(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(training, validation) indices of the training files: the fold, else `val_split`."""
        if self.folds:
            return kfold.fold_split(labels, self.folds, self.fold, self.seed, self.class_names)
        perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        val, train = perm.tensor_split([int(round(len(labels) * self.val_split))])
        return train, val

    def _fold_note(self) -> str:
        if not self.folds:
            return ""
        return f" (val: fold {self.fold} of {self.folds}, stratified, seed {self.seed})"

    def _loader(self, split: str) -> DeviceBatches:
        t, train = self.trainer, split == "train"
        return DeviceBatches(
            *self.splits[split],
            self.batch_size if train else self.eval_batch_size,
            torch.tensor(self.spec.mean),
            torch.tensor(self.spec.std),
            train=train,
            augment_cfg=self.augment if train else None,
            seed=self.seed,
            rank=t.global_rank if t else 0,
            world_size=t.world_size if t else 1,
            channels_last=self.channels_last,
            # The same batches every epoch under overfit_batches, as Lightning does for DataLoaders.
            shuffle=not (t and t.overfit_batches),
            num_classes=self.num_classes,
        )

    def train_dataloader(self) -> DeviceBatches:
        return self._restored(self._loader("train"))

    def val_dataloader(self):
        return self._loader("val") if len(self.splits["val"][1]) else []

    def test_dataloader(self) -> DeviceBatches:
        return self._loader("test")
