"""Write tiny folders in the official CIFAR python format, so tests never download."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from cifar_amp.data.cifar import SPECS


def write_cifar_folder(
    root: Path, dataset: str = "cifar10", per_file: int = 40, n_test: int = 60, seed: int = 0
) -> Path:
    """Create `root/<base folder>/` with every train/test file of `dataset`; return `root`.

    Images are class-dependent (a per-class colour plus noise), so a model can learn them.
    """
    spec = SPECS[dataset]
    folder = root / spec.tv.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    palette = rng.integers(0, 256, size=(spec.num_classes, 3))
    label_key = "labels" if dataset == "cifar10" else "fine_labels"

    def batch(n: int) -> dict:
        labels = rng.integers(0, spec.num_classes, size=n)
        base = np.repeat(palette[labels], 1024, axis=1)  # (n, 3072), channel-major like CIFAR
        noise = rng.integers(-40, 41, size=(n, 3072))
        data = np.clip(base + noise, 0, 255).astype(np.uint8)
        return {
            "batch_label": "tiny",
            label_key: labels.tolist(),
            "data": data,
            "filenames": [f"{i}.png" for i in range(n)],
        }

    for name in spec.files("train"):
        (folder / name).write_bytes(pickle.dumps(batch(per_file)))
    for name in spec.files("test"):
        (folder / name).write_bytes(pickle.dumps(batch(n_test)))
    return root
