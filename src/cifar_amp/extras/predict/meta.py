"""What a checkpoint's network expects of its images (class names, mean/std, size; README.md
here), so that predict and export need no data set: the `DataMeta` callback, one of the default
callbacks, writes it into every checkpoint's `hyper_parameters["data_meta"]`."""

import logging
import pickle
from pathlib import Path
from typing import Protocol, runtime_checkable

from lightning import Callback
from torchvision.datasets import CIFAR10, CIFAR100

from cifar_amp.data.cifar import CIFARDataModule, Spec

log = logging.getLogger(__name__)
KEY = "data_meta"  # of a checkpoint's hyper_parameters

# The official label names, for CIFAR folders without a names file.
OFFICIAL_NAMES = {
    CIFAR10: "airplane automobile bird cat deer dog frog horse ship truck".split(),
    CIFAR100: """apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy
bridge bus butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach
couch crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster house kangaroo
keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree motorcycle mountain mouse
mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree plain plate poppy
porcupine possum rabbit raccoon ray road rocket rose sea seal shark shrew skunk skyscraper snail
snake spider squirrel streetcar sunflower sweet_pepper table tank telephone television tiger
tractor train trout tulip turtle wardrobe whale willow_tree wolf woman worm""".split(),
}


@runtime_checkable
class DescribesData(Protocol):
    """DataModule that says what its network expects, as `meta`: a Protocol, so a DataModule
    need only have the property. Implemented by: extras/image_folders (ImageFolderDataModule);
    the core's CIFARDataModule is described by `cifar_meta`."""

    meta: dict


def cifar_meta(spec: Spec, folder: Path | None = None) -> dict:
    """What a network trained on `spec`'s data expects; the class names of `folder`'s names file."""
    names, path = OFFICIAL_NAMES[spec.tv], folder and folder / spec.tv.meta["filename"]
    try:
        with open(path, "rb") as f:
            found = [str(n) for n in pickle.load(f, encoding="latin1")[spec.tv.meta["key"]]]
        names = found if len(found) == spec.num_classes else names
    except (TypeError, FileNotFoundError):  # no folder, no names file: the official names
        pass
    except Exception as e:  # only the names are lost
        log.warning("%s is unreadable (%s); using the official class names", path, e)
    mean, std = list(spec.mean), list(spec.std)
    return {"class_names": list(names), "mean": mean, "std": std, "image_size": [32, 32]}


def describe(dm) -> dict | None:
    """`dm`'s meta; for a CIFARDataModule, its data set's and the test batch it tests on."""
    if isinstance(dm, DescribesData):
        return dm.meta
    if not isinstance(dm, CIFARDataModule):
        return None
    folder = dm.spec.find(dm.data_dir) or Path(dm.data_dir) / dm.spec.tv.base_folder
    test_images = str((folder / dm.spec.files("test")[0]).resolve())
    return cifar_meta(dm.spec, folder) | {"test_images": test_images}


class DataMeta(Callback):
    """Writes the DataModule's meta into each checkpoint (read once, at the first save)."""

    def __init__(self) -> None:
        self.meta: dict | None = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self.meta = self.meta or describe(trainer.datamodule)
        if self.meta is not None:
            checkpoint.setdefault("hyper_parameters", {})[KEY] = self.meta
