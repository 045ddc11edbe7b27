"""A CIFAR-10 folder (official python format) of any size, for timings: the speed of a training
step does not depend on the pixels, so a folder's images are repeated, or random pixels made
where none is given. Accuracies on such data mean nothing."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from cifar_amp.data.cifar import SPECS

SPEC = SPECS["cifar10"]


def write(
    root: Path, n_train: int, n_test: int, source: str | Path | None = None, seed: int = 0
) -> tuple[Path, str]:
    """`root/cifar-10-batches-py/` with `n_train` training and `n_test` test images: those of
    the CIFAR-10 folder `source`, repeated as needed, else random pixels and labels. Returns
    (root, what the images are, in words)."""
    folder = root / SPEC.tv.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    found = SPEC.find(source) if source else None
    if found is not None:
        pools = {s: SPEC.read(found, s) for s in ("train", "test")}
        pools = {s: (x.numpy().reshape(len(x), -1), y.numpy()) for s, (x, y) in pools.items()}
        what = f"{len(pools['train'][1]):,} real training images of {found}, repeated"
    else:
        rng = np.random.default_rng(seed)
        pools = {
            s: (
                rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
                rng.integers(0, SPEC.num_classes, size=n),
            )
            for s, n in (("train", min(n_train, 10_000)), ("test", min(n_test, 10_000)))
        }
        what = "random pixels (no CIFAR folder given)"

    def take(split: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = pools[split]
        idx = np.arange(n) % len(y)
        return x[idx], y[idx]

    files = SPEC.files("train")
    x, y = take("train", n_train)
    for name, part in zip(files, np.array_split(np.arange(n_train), len(files)), strict=True):
        _dump(folder / name, x[part], y[part])
    x, y = take("test", n_test)
    (name,) = SPEC.files("test")
    _dump(folder / name, x, y)
    return root, what


def _dump(path: Path, data: np.ndarray, labels: np.ndarray) -> None:
    entry = {"batch_label": path.name, "labels": labels.tolist(), "data": data}
    path.write_bytes(pickle.dumps(entry, protocol=4))
