"""Write a folder of image files in torchvision's ImageFolder layout (`<root>/<class>/<n>.png`)
from CIFAR batch files: the real CIFAR-10 subset where there is one (SUBSET in conftest.py),
else a tiny synthetic folder (tests/cifar_folder.py), so that the tests also run in CI.

    python tests/extras/image_folders/image_folder.py <cifar folder> <out folder> [class names...]   # docs/fork.md
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
from PIL import Image

NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def write_image_folder(
    cifar_dir: Path,
    out: Path,
    classes: tuple[int, ...] = (0, 1, 2),
    per_class: int | None = None,
    files: tuple[str, ...] = ("data_batch_1",),
    fmt: str = "png",
) -> Path:
    """`out/<class name>/<i>.<fmt>` for the images of `classes` in `files` of `cifar_dir`
    (a folder holding cifar-10-batches-py/), at most `per_class` each; returns `out`."""
    batches = cifar_dir / "cifar-10-batches-py"
    written = dict.fromkeys(classes, 0)
    for name in files:
        with open(batches / name, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        images = np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        for image, label in zip(images, entry["labels"], strict=True):
            if label not in written or written[label] == per_class:
                continue
            folder = out / NAMES[label]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image.transpose(1, 2, 0)).save(folder / f"{written[label]}.{fmt}")
            written[label] += 1
    return out


if (
    __name__ == "__main__"
):  # <out>/train/<class>/ from data_batch_*, <out>/test/<class>/ from test_batch
    src, dst = map(Path, sys.argv[1:3])
    picked = tuple(NAMES.index(c) for c in sys.argv[3:]) or tuple(range(10))
    train_files = tuple(f"data_batch_{i}" for i in range(1, 6))
    write_image_folder(src, dst / "train", picked, files=train_files)
    write_image_folder(src, dst / "test", picked, files=("test_batch",))
