"""Lightning loop vs the plain-PyTorch reference loop, side by side in one process.

    python -m bench.framework                      # CPU, SpeedNet at a small width
    python -m bench.framework --device cuda --n-images 50000 --batch-size 1024 \
        --widths 64,256,256 --precision bf16-mixed --channels-last --fused --compile
    python -m bench.framework --device cuda --n-images 50000 --batch-size 512 --model resnet18 \
        --precision 16-mixed --channels-last --fused [--compile]
    python -m bench.framework --widths 4,4,4 --batch-size 8 --n-images 1024   # host overhead

Both loops train the same network (same initial weights) on the same device-resident
random-pixel images of CIFAR shape (the speed of a loop does not depend on the pixels), with
the same augmentation, precision, optimizer, schedule and label smoothing as the speedrun
recipe (`--fused`: both with the fused SGD; `--compile`: both networks compiled, in
`--compile-mode`). Runs alternate (plain, Lightning, plain, ...) so that a busy shared machine
slows both alike; the report gives images/s per loop (median over repeats), Lightning's seconds
per epoch, the ratio Lightning / plain, and milliseconds per step of each loop and their
difference: with a tiny network (`--widths 4,4,4 --batch-size 8`) the step is almost all host
work, as it is on a GPU, so the difference is Lightning's host overhead per step. Lightning
runs as the recipe runs it, minus checkpointing and logging (they are per-epoch file writes,
not loop cost): no progress bar, no sanity check.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import time
import warnings

import lightning as L
import torch
from hydra.utils import instantiate

from bench import reference_loop
from cifar_amp.data import SPECS, Augment, DeviceBatches
from cifar_amp.module import ImageClassifier
from cifar_amp.precision import Precision


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock(L.Callback):
    """Wall time from the first training batch's epoch start to the end of training."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.start = device, None, None

    def on_train_start(self, trainer, pl_module):
        sync(self.device)
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        sync(self.device)
        self.seconds = time.perf_counter() - self.start


def make_data(
    n: int, device: torch.device, batch_size: int, seed: int, channels_last: bool
) -> DeviceBatches:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g).to(device)
    labels = torch.randint(0, 10, (n,), generator=g).to(device)
    spec = SPECS["cifar10"]
    augment = Augment(flip=True, alternate_flip=True, translate=2)
    return DeviceBatches(
        images,
        labels,
        batch_size,
        torch.tensor(spec.mean),
        torch.tensor(spec.std),
        train=True,
        augment_cfg=augment,
        seed=seed,
        channels_last=channels_last,
    )


def make_module(args) -> ImageClassifier:
    # The module's own optimizer and schedule (its constructor's defaults), at `--lr`.
    defaults = inspect.signature(ImageClassifier).parameters
    torch.manual_seed(args.seed)
    net = {"_target_": "cifar_amp.models.resnet.ResNet18"}
    if args.model == "speednet":
        net = {"_target_": "cifar_amp.models.speednet.SpeedNet", "widths": args.widths}
    optimizer = defaults["optimizer"].default | {"lr": args.lr, "fused": args.fused or None}
    return ImageClassifier(
        net=net,
        num_classes=10,
        optimizer=optimizer,
        scheduler=defaults["scheduler"].default,  # its peak is the optimizer's lr
        label_smoothing=args.label_smoothing,
        channels_last=args.channels_last,
        compile=args.compile,
        compile_mode=args.compile_mode,
    )


def run_lightning(
    module: ImageClassifier, loader: DeviceBatches, args, device: torch.device
) -> float:
    clock, prec = Clock(device), Precision(args.precision)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        benchmark=device.type == "cuda",
        callbacks=[clock],
        precision=prec.trainer_precision,
    )
    prec.setup(trainer)
    trainer.fit(module, train_dataloaders=loader)
    return clock.seconds


def run_plain(module: ImageClassifier, loader: DeviceBatches, args, device: torch.device) -> float:
    net = module.net.to(device)
    if args.compile:
        net.compile(mode=args.compile_mode)
    # As configure_optimizers builds them.
    optimizer = instantiate(module.hparams.optimizer, params=net.parameters())
    total = args.epochs * len(loader)
    scheduler = instantiate(module.hparams.scheduler, optimizer=optimizer, total_steps=total)
    sync(device)
    start = time.perf_counter()
    reference_loop.fit(
        net, loader, optimizer, scheduler, args.epochs, args.precision, args.label_smoothing
    )
    sync(device)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n-images", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--model", default="speednet", choices=["speednet", "resnet18"])
    ap.add_argument("--widths", default="16,32,64", help="SpeedNet widths, comma-separated")
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per loop, alternating")
    ap.add_argument(
        "--precision", default="32-true", choices=sorted(reference_loop.AUTOCAST) + ["32-true"]
    )
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--label-smoothing", type=float, default=0.2)
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--fused", action="store_true", help="fused SGD in both loops")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",")]
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    loader = make_data(args.n_images, device, args.batch_size, args.seed, args.channels_last)
    initial = make_module(args)
    times: dict[str, list[float]] = {"plain": [], "lightning": []}
    runners = {"plain": run_plain, "lightning": run_lightning}
    for i in range(args.repeats + 1):  # the first round warms up (allocator, cudnn, compile)
        for name, run in runners.items():
            seconds = run(copy.deepcopy(initial), loader, args, device)
            if i:
                times[name].append(seconds)
    images = args.epochs * len(loader) * args.batch_size
    rate = {k: images / statistics.median(v) for k, v in times.items()}
    steps = args.epochs * len(loader)
    ms = {k: statistics.median(v) / steps for k, v in times.items()}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "device": device_name,
        "threads": torch.get_num_threads(),
        "images_per_epoch": len(loader) * args.batch_size,
        "model": args.model,
        "widths": args.widths if args.model == "speednet" else None,
        "batch_size": args.batch_size,
        "precision": args.precision,
        "channels_last": args.channels_last,
        "fused": args.fused,
        "compile": args.compile and args.compile_mode,
        "plain_images_per_s": round(rate["plain"], 1),
        "lightning_images_per_s": round(rate["lightning"], 1),
        "lightning_s_per_epoch": round(statistics.median(times["lightning"]) / args.epochs, 4),
        "ratio_lightning_over_plain": round(rate["lightning"] / rate["plain"], 3),
        "ms_per_step": {k: round(1e3 * v, 3) for k, v in ms.items()},
        "lightning_extra_ms_per_step": round(1e3 * (ms["lightning"] - ms["plain"]), 3),
        "runs_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
