"""What predict and export read: image files (a folder of them, or one) or a CIFAR batch file,
as uint8 images at the network's resolution.

Images are decoded with Pillow (PNG, JPEG and the other formats it reads; torchvision's own
decoders are deprecated since 0.29), turned to RGB, and resized with torchvision's v2
transforms as torchvision's classification presets do: the shorter side to the training
resolution, then a centre crop, so that nothing is stretched. Files that cannot be decoded are
listed, not fatal: the caller predicts the others and reports them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2

from cifar_amp.data import SPECS
from cifar_amp.data.cifar import read_class_names
from cifar_amp.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@dataclass
class Inputs:
    """Readable images in input order, and what could not be read."""

    names: list[str]  # one per image: a path relative to the input, or `<batch file>[i]`
    images: torch.Tensor  # (N, 3, H, W) uint8 at the network's resolution
    labels: list[str] | None = None  # true class names, where the input carries them
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (name, why)


def resize(image_size: list[int]) -> v2.Transform:
    """uint8 image(s) of any size -> `image_size` [H, W]: shorter side, then centre crop."""
    return v2.Compose([v2.Resize(max(image_size), antialias=True), v2.CenterCrop(image_size)])


def read(path: str | Path, meta: dict, num_classes: int) -> Inputs:
    """`path` (a folder of images, an image file or a CIFAR batch file) for a network that
    expects `meta` (class names, image size): one-line UserError if nothing can be read."""
    root = Path(path)
    if root.is_dir():
        files = sorted(
            p
            for p in root.rglob("*")
            if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file() and not _hidden(p, root)
        )
        if not files:
            hint = _batch_file_hint(root)
            raise UserError(
                f"input={path} holds no images ({', '.join(IMAGE_SUFFIXES)}, in any subfolder)"
                + hint
            )
        return _read_images(files, root, meta["image_size"])
    if not root.is_file():
        raise UserError(f"input={path}: no such file or folder")
    if root.suffix.lower() in IMAGE_SUFFIXES:
        return _read_images([root], root.parent, meta["image_size"])
    return read_batch_file(root, meta, num_classes)


def _hidden(p: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in p.relative_to(root).parts)


def _batch_file_hint(root: Path) -> str:
    names = {p.name for p in root.iterdir()}
    for spec in SPECS.values():
        if found := [n for n in spec.test_files + spec.train_files if n in names]:
            return f"; for a CIFAR batch file give the file itself, e.g. input={root / found[0]}"
    return ""


def _read_images(files: list[Path], root: Path, image_size: list[int]) -> Inputs:
    to_size = v2.Compose([v2.ToImage(), resize(image_size)])
    names, images, unreadable = [], [], []
    for path in files:
        name = path.relative_to(root).as_posix()
        try:
            with Image.open(path) as im:
                rgb = ImageOps.exif_transpose(im).convert("RGB")  # as the camera held it
        except Exception as e:  # Pillow's errors for broken, truncated or foreign files vary
            unreadable.append((name, f"{type(e).__name__}: {str(e).replace(str(path), name)}"))
            continue
        names.append(name)
        images.append(to_size(rgb).as_subclass(torch.Tensor))
    h, w = image_size
    stacked = torch.stack(images) if images else torch.empty(0, 3, h, w, dtype=torch.uint8)
    return Inputs(names, stacked, unreadable=unreadable)


def read_batch_file(path: Path, meta: dict, num_classes: int) -> Inputs:
    """A file in CIFAR's python format (`data`, and `labels` or `fine_labels`). Its labels
    and the names file beside it (batches.meta / meta) say which dataset it is; a network
    trained on another is refused, as its predictions would be meaningless."""
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        data = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    except Exception as e:
        raise UserError(
            f"input={path} is neither an image ({', '.join(IMAGE_SUFFIXES)}) nor a CIFAR batch "
            f"file ({type(e).__name__}: {e})"
        ) from e
    key = next((k for k in ("labels", "fine_labels") if k in entry), None)
    theirs, ours = _input_classes(path, key), meta.get("class_names")
    if theirs is not None and (list(theirs) != list(ours) if ours else len(theirs) != num_classes):
        trained = f"{num_classes}" + (f": {', '.join(ours[:3])}, ..." if ours else "")
        raise UserError(
            f"input={path} is labelled for other classes ({len(theirs)}: "
            f"{', '.join(theirs[:3])}, ...) than the checkpoint was trained on ({trained}): "
            "use a checkpoint trained on that dataset"
        )
    labels = None
    if key is not None:
        ids = np.asarray(entry[key], dtype=np.int64)
        if len(ids) != len(data):
            raise UserError(f"input={path} has {len(ids)} labels for {len(data)} images")
        if len(ids) and (ids.min() < 0 or ids.max() >= num_classes):
            raise UserError(
                f"input={path} has labels in [{ids.min()}, {ids.max()}], beyond the "
                f"checkpoint's {num_classes} classes: use a checkpoint trained on that dataset"
            )
        labels = [ours[i] if ours else str(i) for i in ids]
    images = resize(meta["image_size"])(torch.from_numpy(data))
    return Inputs([f"{path.name}[{i}]" for i in range(len(data))], images, labels)


def _input_classes(path: Path, key: str | None) -> list[str] | None:
    """The class names a CIFAR batch file is labelled with: its folder's names file, else
    the official ones of the format its label key stands for (CIFAR-10 or CIFAR-100)."""
    spec = {"labels": SPECS["cifar10"], "fine_labels": SPECS["cifar100"]}.get(key)
    if spec is None:
        return None
    return read_class_names(path.parent, spec) or list(spec.classes)
