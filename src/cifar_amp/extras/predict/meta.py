"""What a checkpoint's network expects of its images (class names, mean/std, size; README.md
here), so that predict and export need no data set: the `DataMeta` callback, one of the default
callbacks, writes it into every checkpoint's `hyper_parameters["data_meta"]`."""

from pathlib import Path
from typing import Protocol, runtime_checkable

from lightning import Callback

from cifar_amp.data.cifar import CIFARDataModule, Spec

KEY = "data_meta"  # of a checkpoint's hyper_parameters


@runtime_checkable
class DescribesData(Protocol):
    """DataModule that says what its network expects, as `meta`: a Protocol, so a DataModule
    need only have the property. Implemented by: extras/image_folders (ImageFolderDataModule);
    the core's CIFARDataModule is described by `cifar_meta`."""

    meta: dict


def cifar_meta(spec: Spec, folder: Path | None = None) -> dict:
    """What a network trained on `spec`'s data expects; the class names of `folder`'s names file."""
    mean, std = list(spec.mean), list(spec.std)
    names = spec.class_names(folder)
    return {"class_names": names, "mean": mean, "std": std, "image_size": [32, 32]}


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
