"""The template's training loader against torchvision's usual CIFAR pipeline, in one run.

    python -m bench.loader_speed --data-dir /work/shared/data/cifar10-subset

Both serve the training split of the same folder at the same batch size with the same kind
of augmentation (random crop with 4-pixel padding, random horizontal flip, normalisation):
- template: CIFARDataModule's DeviceBatches (uint8 tensors on the device, batch-wise ops);
- torchvision: CIFAR10 + RandomCrop(32, padding=4) + RandomHorizontalFlip + ToTensor +
  Normalize through a DataLoader with 2 workers, the batch moved to the device.
Each loader is timed over whole epochs after one warm-up epoch (worker start-up included
for torchvision, as every epoch pays it without persistent workers); runs alternate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils.data import DataLoader
from torchvision import transforms

from bench.compat import UncheckedCIFAR10
from cifar_amp.data.augment import Augment
from cifar_amp.data.cifar import SPECS, CIFARDataModule


def epoch_seconds(loader, device: torch.device, epoch: int) -> tuple[float, int]:
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    start = time.perf_counter()
    n = 0
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        n += len(x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, n


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data-dir", required=True, help="folder holding cifar-10-batches-py/")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per loader")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers for torchvision")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    spec = SPECS["cifar10"]

    dm = CIFARDataModule(
        data_dir=args.data_dir,
        download=False,
        batch_size=args.batch_size,
        val_split=0.0,
        augment=Augment(flip=True, translate=4),
    )
    dm.setup("fit")
    dm.splits = {k: (x.to(device), y.to(device)) for k, (x, y) in dm.splits.items()}
    ours = dm.train_dataloader()

    tv = UncheckedCIFAR10(
        str(spec.find(args.data_dir).parent),
        train=True,
        transform=transforms.Compose(
            [
                transforms.RandomCrop(32, padding=4),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(spec.mean, spec.std),
            ]
        ),
    )
    theirs = DataLoader(
        tv,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        drop_last=True,
    )
    loaders = {"template": ours, "torchvision": theirs}
    times: dict[str, list[float]] = {k: [] for k in loaders}
    counts: dict[str, int] = {}
    for epoch in range(args.epochs + 1):  # epoch 0 warms up
        for name, loader in loaders.items():
            seconds, counts[name] = epoch_seconds(loader, device, epoch)
            if epoch:
                times[name].append(seconds)
    rate = {k: counts[k] / statistics.median(v) for k, v in times.items()}
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "train_images": len(tv),
        "batch_size": args.batch_size,
        "workers": args.workers,
        "template_images_per_s": round(rate["template"], 1),
        "torchvision_images_per_s": round(rate["torchvision"], 1),
        "speedup": round(rate["template"] / rate["torchvision"], 1),
        "epoch_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
