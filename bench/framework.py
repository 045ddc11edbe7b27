"""The template's Lightning run of a recipe vs the plain-PyTorch reference loop, side by side
in one process.

    python -m bench.framework                      # CPU, SpeedNet at a small width
    python -m bench.framework --widths 4,4,4 --batch-size 8 --n-images 1024   # host work
    python -m bench.framework --device cuda --n-images 50000 --batch-size 1024 \
        --widths 64,256,256 --precision bf16-mixed --fused --compile
    python -m bench.framework --device cuda --n-images 50000 --batch-size 512 --model resnet18 \
        --precision 16-mixed --channels-last --fused [--compile]

The Lightning side is the run `train.py experiment=speedrun_gpu` builds (`--recipe`), as
configured: its Trainer settings, logger, checkpoints and every callback (reliability,
diagnostics, curves, EMA, patch whitening...; for ResNet-18, which has no whitening stem, all
but that one), with the network, batch, precision, fused optimizer and compilation that the
flags give; no test. The plain side trains the same network (same initial weights, the same
layer frozen where the recipe whitens one) in a hand-written loop (bench/reference_loop.py)
with the same precision, optimizer, schedule, label smoothing and device-resident batches
(the recipe's DataModule and augmentation), and nothing else. Both read the same CIFAR-10
folder of `--n-images` images (random pixels unless `--data-dir`: speed does not depend on
them).

Runs alternate (Lightning, plain, then plain, Lightning, ...) so that a busy shared machine
slows both alike; the first round (`--warmup-rounds`) warms up (allocator, cuDNN autotuning,
compilation). Each
loop is timed per epoch over its batches, from the epoch's start to the end of its last batch
(the device synchronised at both ends): per-epoch work (logging, checkpoint writes) is not
loop cost. The report gives images/s per loop (median over repeats), the ratio Lightning /
plain, Lightning's seconds per epoch, milliseconds per step of each loop and their
difference, `lightning_extra_ms_per_step`: with a tiny network (`--widths 4,4,4
--batch-size 8`) a step is almost all host work, as on a GPU, so that difference is what
Lightning, the module and the recipe's callbacks add to the host work of a step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

from bench import reference_loop, synthetic
from bench.reference_loop import sync
from cifar_amp import config, training

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class EpochClock(L.Callback):
    """Each training epoch's time by `clock`, from its start to the end of its last batch."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.seconds: list[float] = []
        self.clock, self._t0 = clock, 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        sync(pl_module.device)
        self._t0 = self.clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch_idx + 1 == trainer.num_training_batches:
            sync(pl_module.device)
            self.seconds.append(self.clock() - self._t0)


def recipe_cfg(args, data_dir: Path, run_dir: Path) -> DictConfig:
    """The recipe's composed config with the flags' network, batch, precision and device."""
    overrides = [
        f"experiment={args.recipe}",
        f"data.data_dir={data_dir}",
        "data.download=false",
        f"data.batch_size={args.batch_size}",
        f"trainer.max_epochs={args.epochs}",
        "trainer.enable_model_summary=false",
        f"precision={args.precision}",
        f"module.optimizer.fused={str(args.fused).lower()}",
        f"module.compile={str(args.compile).lower()}",
        f"module.compile_mode={args.compile_mode}",
        "test=false",
        f"seed={args.seed}",
        f"run_dir={run_dir}",
    ]
    if args.device == "cpu":
        overrides += ["trainer=cpu"]
    else:
        overrides += ["trainer.accelerator=gpu", "trainer.devices=1"]
    if args.channels_last:
        overrides.append("precision.channels_last=true")
    if args.model == "speednet":
        overrides.append(f"model.widths=[{','.join(map(str, args.widths))}]")
    config.register(CONFIGS)
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
        if args.model == "resnet18":  # the recipe's model settings are SpeedNet's
            resnet = compose("train", overrides=["model=resnet18"]).model
    if args.model == "resnet18":
        with open_dict(cfg):
            cfg.model = resnet
            cfg.callbacks.pop("whiten", None)  # needs SpeedNet's whitening stem
    return cfg


def frozen(cfg: DictConfig) -> list[str]:
    """Parameters the recipe freezes at fit start (the whitened stem's weight)."""
    node = (cfg.get("callbacks") or {}).get("whiten")
    if not node or not node.get("freeze", True):
        return []
    return [node.get("layer", "net.stem").removeprefix("net.") + ".weight"]


def run_lightning(cfg: DictConfig, clock=time.perf_counter) -> tuple[list[float], training.Run]:
    run = training.build_run(cfg)
    clock = EpochClock(clock)
    run.trainer.callbacks.append(clock)
    with training.holding_run_dir(run):
        training.record_config(run)
        training.fit(run)
    return clock.seconds, run


def run_plain(
    initial: L.LightningModule,
    loader,
    epochs: int,
    precision: str,
    freeze: list[str],
    around=None,  # a context the training loop runs in (a profiler)
    clock=time.perf_counter,
) -> list[float]:
    module = copy.deepcopy(initial).to(loader.images.device)
    net = module.net
    for name in freeze:
        net.get_parameter(name).requires_grad_(False)
    if module.hparams.compile:
        net.compile(mode=module.hparams.compile_mode)
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = instantiate(module.hparams.optimizer, params=params)  # as configure_optimizers
    total = epochs * len(loader)
    scheduler = module.hparams.scheduler and instantiate(
        module.hparams.scheduler, optimizer=optimizer, total_steps=total
    )
    seconds: list[float] = []
    with around or contextlib.nullcontext():
        reference_loop.fit(
            net,
            loader,
            optimizer,
            scheduler,
            epochs,
            precision,
            module.hparams.label_smoothing,
            epoch_seconds=seconds,
            clock=clock,
        )
    return seconds


def compare(args, work: Path, data_dir: Path | None = None) -> dict:
    """Both loops, `args.repeats` timed rounds after `args.warmup_rounds`; the report.
    `data_dir`: a CIFAR-10 folder of `args.n_images` training images made already."""
    if data_dir is None:
        data_dir, images = synthetic.write(
            work / "data", args.n_images, 16, args.data_dir, seed=args.seed
        )
    else:
        images = f"{args.n_images:,} images of {data_dir}"
    cfg = recipe_cfg(args, data_dir, work / "run")
    initial = training.build_run(cfg).module  # the weights both loops start from
    times: dict[str, list[float]] = {"plain": [], "lightning": []}
    clock = time.process_time if args.cpu_time else time.perf_counter
    loader, run, steps, names = None, None, 0, []
    for i in range(args.warmup_rounds + args.repeats):
        order = ("lightning", "plain") if i % 2 == 0 else ("plain", "lightning")
        for name in order:
            if name == "lightning":
                cfg.run_dir = str(work / f"run{i}")
                seconds, run = run_lightning(cfg, clock)
                steps = run.trainer.num_training_batches
                names = [type(c).__name__ for c in run.trainer.callbacks][:-1]  # not the clock
                # The recipe's own DataModule and augmentation, on the device, for the plain loop
                loader = loader or run.datamodule.train_dataloader()
            else:
                seconds = run_plain(
                    initial, loader, args.epochs, args.precision, frozen(cfg), clock=clock
                )
            if i >= args.warmup_rounds:
                times[name].append(sum(seconds))
    batch = args.batch_size
    images_per_epoch = steps * batch
    rate = {k: args.epochs * images_per_epoch / statistics.median(v) for k, v in times.items()}
    ms = {k: 1e3 * statistics.median(v) / (args.epochs * steps) for k, v in times.items()}
    device = run.trainer.strategy.root_device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "recipe": f"experiment={args.recipe}",
        "callbacks": names,
        "images": images,
        "images_per_epoch": images_per_epoch,
        "model": args.model,
        "widths": args.widths if args.model == "speednet" else None,
        "batch_size": batch,
        "precision": args.precision,
        "channels_last": run.precision.channels_last,
        "fused": args.fused,
        "compile": args.compile and args.compile_mode,
        "clock": "process CPU time, one thread" if args.cpu_time else "wall time",
        "plain_images_per_s": round(rate["plain"], 1),
        "lightning_images_per_s": round(rate["lightning"], 1),
        "lightning_s_per_epoch": round(statistics.median(times["lightning"]) / args.epochs, 4),
        "ratio_lightning_over_plain": round(rate["lightning"] / rate["plain"], 3),
        "ms_per_step": {k: round(v, 3) for k, v in ms.items()},
        "lightning_extra_ms_per_step": round(ms["lightning"] - ms["plain"], 3),
        "runs_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.framework",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--recipe", default="speedrun_gpu", help="an experiment= config")
    ap.add_argument("--data-dir", help="a CIFAR-10 folder whose images are repeated")
    ap.add_argument("--n-images", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--model", default="speednet", choices=["speednet", "resnet18"])
    ap.add_argument("--widths", default="16,32,64", help="SpeedNet widths, comma-separated")
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per loop, alternating")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="untimed runs per loop first")
    ap.add_argument(
        "--precision", default="32-true", choices=sorted(reference_loop.AUTOCAST) + ["32-true"]
    )
    ap.add_argument("--channels-last", action="store_true", help="else the precision decides")
    ap.add_argument("--fused", action="store_true", help="fused SGD in both loops")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="CPU only: time by this process's CPU time, on one thread (on a shared machine, "
        "wall time varies 2-4x with the load; CPU time much less)",
    )
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.cpu_time:
        if args.device != "cpu":
            raise SystemExit("--cpu-time: CPU only (a GPU's work is not this process's CPU time)")
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    with tempfile.TemporaryDirectory() as tmp:
        report = compare(args, Path(tmp))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
