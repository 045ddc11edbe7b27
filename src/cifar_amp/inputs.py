"""What predict and export read (image files or a CIFAR batch file), as uint8 images at the
network's resolution; files that cannot be decoded are listed, not fatal."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchvision.transforms import v2

from cifar_amp.data.cifar import SPECS, read_batch
from cifar_amp.data.images import SUFFIXES, decode, eval_resize
from cifar_amp.errors import UserError


@dataclass
class Inputs:
    """Readable images in input order, and what could not be read."""

    names: list[str]  # one per image: a path relative to the input, or `<batch file>[i]`
    images: torch.Tensor  # (N, 3, H, W) uint8 at the network's resolution
    labels: list[str] | None = None  # true class names, where the input carries them
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (name, why)


def read(path: str | Path, meta: dict, num_classes: int) -> Inputs:
    """`path` for a network that expects `meta`; UserError if nothing can be read."""
    root = Path(path)
    if root.is_dir():
        hidden = lambda p: any(part.startswith(".") for part in p.relative_to(root).parts)  # noqa: E731
        files = sorted(
            p
            for p in root.rglob("*")
            if p.suffix.lower() in SUFFIXES and p.is_file() and not hidden(p)
        )
        if not files:
            raise UserError(
                f"input={path} holds no images ({', '.join(SUFFIXES)}, in any subfolder){_batch_file_hint(root)}"
            )
        return _read_images(files, root, meta["image_size"])
    if not root.is_file():
        raise UserError(f"input={path}: no such file or folder")
    if root.suffix.lower() in SUFFIXES:
        return _read_images([root], root.parent, meta["image_size"])
    return read_batch_file(root, meta, num_classes)


def _batch_file_hint(root: Path) -> str:
    names = {p.name for p in root.iterdir()}
    for spec in SPECS.values():
        if found := [n for n in spec.files("test") + spec.files("train") if n in names]:
            return f"; for a CIFAR batch file give the file itself, e.g. input={root / found[0]}"
    return ""


def _read_images(files: list[Path], root: Path, image_size: list[int]) -> Inputs:
    to_size = v2.Compose([v2.ToImage(), eval_resize(image_size)])
    names, images, unreadable = [], [], []
    for path in files:
        name = path.relative_to(root).as_posix()
        try:
            rgb = decode(str(path))
        except UserError as e:
            cause = e.__cause__ or e
            unreadable.append((name, f"{type(cause).__name__}: {cause}".replace(str(path), name)))
            continue
        names.append(name)
        images.append(to_size(rgb).as_subclass(torch.Tensor))
    h, w = image_size
    stacked = torch.stack(images) if images else torch.empty(0, 3, h, w, dtype=torch.uint8)
    return Inputs(names, stacked, unreadable=unreadable)


def read_batch_file(path: Path, meta: dict, num_classes: int) -> Inputs:
    """A file in CIFAR's python format; one of a dataset the network was not trained on (by its
    labels and the names file beside it) is refused."""
    try:
        data, ids, key = read_batch(path)
    except UserError as e:
        raise UserError(
            f"input={path} is neither an image ({', '.join(SUFFIXES)}) nor a CIFAR batch file ({e})"
        ) from e
    ours = meta.get("class_names")
    spec = next((s for s in SPECS.values() if s.label_key == key), None)
    theirs = spec and spec.meta(path.parent)["class_names"]
    if theirs is not None and (list(theirs) != list(ours) if ours else len(theirs) != num_classes):
        trained = f"{num_classes}" + (f": {', '.join(ours[:3])}, ..." if ours else "")
        raise UserError(
            f"input={path} is labelled for other classes ({len(theirs)}: {', '.join(theirs[:3])}, ...) "
            f"than the checkpoint was trained on ({trained}): use a checkpoint trained on that dataset"
        )
    if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= num_classes):
        raise UserError(
            f"input={path} has labels in [{ids.min()}, {ids.max()}], beyond the checkpoint's "
            f"{num_classes} classes: use a checkpoint trained on that dataset"
        )
    labels = None if ids is None else [ours[i] if ours else str(i) for i in ids]
    images = eval_resize(meta["image_size"])(torch.from_numpy(data))
    return Inputs([f"{path.name}[{i}]" for i in range(len(data))], images, labels)
