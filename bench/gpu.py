"""`make bench-gpu` (`python -m bench.gpu`): every GPU promise of the template, measured in one
command, as one table: target | measured | holds.

    python -m bench.gpu [--data-dir <CIFAR-10 folder>] [--tests all|gpu|none] [--budget 600]
                        [--airbench <airbench94.py>]

On a CUDA machine (meant to take at most 10 minutes on one H100) it measures:
- precision modes on ResNet-18, batch 512: strict fp32 (TF32 off), 32-true (TF32),
  16-mixed, bf16-mixed, each NCHW and channels_last: images/s and peak memory of the
  template's training step (Lightning, the default callbacks) against the plain PyTorch loop's
  (bench/reference_loop.py) for the same set-up: what the hardware gives. Both loops' memory
  is read in the same window, step by step (bench/memory.py's StepWindow): the step's own
  peak, over what was allocated at its start (the data kept on the device, weights, optimizer
  state), which the targets compare;
- activation checkpointing: each stage setting's step peak and step time against none;
- precision=auto: its probe's choice and time, checked against the modes' measured speed;
- the Lightning loop against the plain loop (bench/framework.py: the run experiment=
  speedrun_gpu builds, every callback) for SpeedNet 64,256,256 batch 1024 bf16-mixed, eager
  and compiled, and ResNet-18 batch 512 16-mixed, eager;
- host work per step: the same comparison at a tiny width (SpeedNet 4,4,4, batch 8), where
  a step is host work, and where its time goes (bench/host_work.py);
- `train.py experiment=speedrun_gpu` on 50,000 training images (those of `--data-dir`
  repeated, or random pixels: speed does not depend on them) in a fresh process: seconds per
  epoch, train_seconds, compile_seconds, fit_seconds; and, given `--airbench`, the public
  airbench94 script (KellerJordan/cifar10-airbench, legacy/airbench94.py) on the same images:
  its seconds per epoch;
- `pytest -m gpu` and the default suite on this machine, their summary lines.
Every section runs in a process of its own, within a share of `--budget` (SHARES, of what the
sections before it left): one that runs past it is killed, and the table says it was cut, after
the cases it finished. After each section the JSON and the table so far are written to the
output folder, so a run killed midway keeps what it finished. At the end it prints the table
and writes it, with the raw JSON and a chart, into the record section
of docs/benchmarks-gpu.md, naming the GPU, driver, torch, Lightning and the other versions.

Without CUDA it is a dry run of the same code at tiny sizes ("not a GPU" in its header),
written to its output folder only (unless `--doc`); bench/tests/test_gpu_bench.py runs it.

It needs torch, torchvision, lightning, torchmetrics, hydra-core and omegaconf (with
PYTHONPATH=src:.); matplotlib (the chart), pytest and pytest-xdist (the test suites, the
default one on 8 workers) only where they are installed. The first lines say what is missing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks-gpu.md"
START = "<!-- bench-gpu record: start (written by `make bench-gpu`; edits inside are lost) -->"
END = "<!-- bench-gpu record: end -->"
NEEDED = {  # import name -> distribution
    "torch": "torch",
    "torchvision": "torchvision",
    "lightning": "lightning",
    "torchmetrics": "torchmetrics",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
}
OPTIONAL = {  # import name -> (distribution, what is lost without it)
    "matplotlib": ("matplotlib", "no chart"),
    "pytest": ("pytest", "the test suites are not run"),
    "xdist": ("pytest-xdist", "the default suite runs on one worker"),
}
# Each section's share of what the sections before it left of --budget (600 s: about 125 s for
# precision, 105 for framework, 160 for the tests; the quick ones leave theirs to the next).
SHARES = {
    "precision": 3.0,
    "checkpointing": 1.0,
    "auto": 1.0,
    "framework": 2.5,
    "host": 1.0,
    "speedrun": 2.0,
    "tests": 4.0,
}
SECTIONS = tuple(SHARES)
RESERVE_S = 10.0  # of --budget, for the start (data, versions) and the end (table, chart)
# Precision modes of the table: (row name, precision overrides).
MODES = (
    ("32-true-strict", ("precision=32-true", "precision.tf32=false")),
    ("32-true", ("precision=32-true", "precision.tf32=true")),
    ("16-mixed", ("precision=16-mixed",)),
    ("bf16-mixed", ("precision=bf16-mixed",)),
)
# Activation checkpointing settings: label -> model overrides (ALL: every stage of the net).
CHECKPOINTING = {
    "none": [],
    "stage 0": ["model.checkpoint_stages=[0]"],
    "stages 0,1": ["model.checkpoint_stages=[0,1]"],
    "every stage": ["model.checkpoint_stages=ALL"],
    "every block": ["model.activation_checkpointing=1"],
}
# Targets (issue 27; docs/benchmarks-gpu.md).
TEMPLATE_RATIO = 0.97  # template / plain loop, images/s, each mode and layout
BEST_16BIT = 0.95  # the template's best 16-bit mode over the plain loop's best, images/s
LAYOUT_SLACK = 1.02  # each mode's default layout: at most 2% slower than its other one
AUTO_WITHIN = 0.95  # precision=auto's choice: within 5% of the table's fastest finite mode
RATIO = 0.95  # Lightning / plain (bench.framework), images/s
MIXED_MEMORY = 0.6  # 16-bit modes' step peak over 32-true's, same layout
CKPT_MEMORY = 0.75  # the best checkpointing setting's step peak over none's
HOST_STEP_MS = 4.0  # airbench94's whole GPU step at batch 1024 on an H100
HOST_EXTRA_MS = 1.0  # Lightning's extra host work per step
FIT_OVER_TRAIN = 1.5  # speedrun_gpu: fit_seconds (compile included) over train_seconds
GPU_TESTS_S = 180.0  # `pytest -m gpu`
AIRBENCH_RUNS = 3  # airbench94's runs read (the first warms up): then it is stopped


SPEEDNET_GPU = ["--widths", "64,256,256", "--batch-size", "1024", "--precision", "bf16-mixed"]
RESNET_GPU = ["--model", "resnet18", "--batch-size", "512", "--precision", "16-mixed"]


@dataclass
class Sizes:
    """What each section runs: `gpu()` is the benchmark, `tiny()` the dry run (a few cases of
    each section, tiny networks, no compilation: the same code, in seconds)."""

    images: int  # training images of the data folder (test images: a fifth)
    net: str  # the network of the precision, checkpointing and auto sections, in words
    model: list[str]  # its overrides
    stages: int  # its stage count (checkpoint_stages settings)
    batch: int
    warmup: int  # untimed steps per case
    timed: int  # timed steps per case
    modes: list[str]  # of MODES, each "<mode> nchw" or "<mode> cl"
    checkpointing: list[str]  # of CHECKPOINTING
    probe_seconds: float  # precision=auto's budget (the config's default on a GPU)
    framework: list[tuple[str, list[str]]]  # (case, bench.framework arguments)
    framework_epochs: int
    framework_repeats: int
    warmup_rounds: int
    host_images: int
    host_repeats: int
    speedrun: list[str] = field(default_factory=list)  # overrides of the recipe's run
    fresh_process: bool = True  # the recipe in its own process (cold start, as a user runs it)

    @classmethod
    def gpu(cls) -> Sizes:
        return cls(
            images=50_000,
            net="ResNet-18",
            model=["model=resnet18"],
            stages=4,
            batch=512,
            warmup=5,
            timed=20,
            modes=[f"{m} {layout}" for m, _ in MODES for layout in ("nchw", "cl")],
            checkpointing=list(CHECKPOINTING),
            probe_seconds=20.0,
            framework=[
                ("SpeedNet 64,256,256 b1024 bf16-mixed", SPEEDNET_GPU),
                ("SpeedNet 64,256,256 b1024 bf16-mixed, compiled", [*SPEEDNET_GPU, "--compile"]),
                ("ResNet-18 b512 16-mixed", [*RESNET_GPU, "--channels-last"]),
            ],
            framework_epochs=2,
            framework_repeats=2,
            warmup_rounds=1,
            host_images=1024,
            host_repeats=2,
        )

    @classmethod
    def tiny(cls) -> Sizes:
        return cls(
            images=64,
            net="SpeedNet 4,4,4 (dry run)",
            model=["model=speednet", "model.widths=[4,4,4]"],
            stages=3,
            batch=16,
            warmup=1,
            timed=2,
            modes=["32-true nchw", "bf16-mixed cl"],
            checkpointing=["none", "stage 0"],
            probe_seconds=1.0,
            framework=[],  # the host section runs the same comparison at a tiny width
            framework_epochs=1,
            framework_repeats=1,
            warmup_rounds=0,
            host_images=64,
            host_repeats=1,
            speedrun=[
                "trainer=cpu",
                "model.widths=[4,4,4]",
                "data.batch_size=16",
                "data.eval_batch_size=32",
                "trainer.max_epochs=1",
                "module.compile=false",
            ],
            fresh_process=False,
        )


# -- what is installed -------------------------------------------------------------------
def missing() -> tuple[list[str], list[str]]:
    """(needed distributions that are missing, lines on the optional ones missing)."""
    need = [d for m, d in NEEDED.items() if importlib.util.find_spec(m) is None]
    nice = [f"{d} ({lost})" for m, (d, lost) in OPTIONAL.items() if not importlib.util.find_spec(m)]
    return need, nice


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def machine(cuda: bool) -> dict:
    """Versions, and the GPU where the benchmark runs on one (`cuda`)."""
    import lightning
    import torch

    info = {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        **{d: version(d) for d in ("torchmetrics", "torchvision", "hydra-core")},
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
    }
    return info


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# -- composing and running the template's config ---------------------------------------------
def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from cifar_amp import config

    config.register(REPO / "configs")
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def datamodule(cfg, layout: bool, trainer, datamodules: dict):
    """The DataModule of this layout, loaded onto the Trainer's device once for all cases."""
    from cifar_amp import build

    if layout not in datamodules:
        dm = datamodules[layout] = build.datamodule(cfg, layout)
        dm.trainer = trainer
        dm.setup("fit")
        dm.trainer = None
    datamodules[layout].batch_size = cfg.data.batch_size
    return datamodules[layout]


def _release() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measured(seconds: list[float], window, batch: int, device) -> dict:
    """Median step after the warm-up, and the memory of `window` (bench/memory.py's StepWindow);
    off CUDA, the process's peak RSS instead."""
    from cifar_amp.diagnostics import peak_rss_mb

    step = statistics.median(seconds[window.warmup :])
    cuda = device.type == "cuda"
    return {
        "step_ms": 1e3 * step,
        "images_per_sec": batch / step,
        "peak_mb": window.peak_mb if cuda else peak_rss_mb(),
        "step_peak_mb": window.step_peak_mb,
        "base_mb": window.base_mb,
    }


def lightning_steps(cfg, sizes: Sizes, datamodules: dict) -> dict:
    """The template's steps: median step time and the steps' memory."""
    import lightning as L
    import torch

    from bench.precision_modes import StepMeter, parts
    from cifar_amp import build
    from cifar_amp.errors import UserError

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    meter = StepMeter(sizes.warmup)
    try:
        trainer, dm, module = parts(cfg, [*build.callbacks(cfg), meter], datamodules)
        trainer.fit(module, datamodule=dm)
    except UserError as e:  # e.g. bf16 on a GPU without it
        return {"skipped": str(e)}
    except torch.OutOfMemoryError:
        return {"skipped": "out of memory"}
    finally:
        for dm in datamodules.values():
            dm.trainer = None  # a reused DataModule must not keep this case's model alive
    # Not module.device: Lightning's teardown has moved the module back to the CPU.
    device = trainer.strategy.root_device
    measured = _measured(meter.seconds, meter.memory, cfg.data.batch_size, device)
    return measured | {"channels_last": bool(module.hparams.channels_last)}


def plain_steps(cfg, sizes: Sizes, datamodules: dict) -> dict:
    """The same set-up in the plain loop: same network and initial weights, precision, TF32
    setting, layout, optimizer, schedule and device-resident batches; each step's memory in
    the window the template's steps get (the batch fetched before it opens)."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

    from bench.memory import StepWindow
    from bench.reference_loop import Step
    from cifar_amp import build
    from cifar_amp.errors import UserError

    try:
        prec = build.precision(cfg)
        trainer = build.trainer(cfg, prec)  # sets TF32 and the layout for its device
    except UserError as e:
        return {"skipped": str(e)}
    device = trainer.strategy.root_device
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    dm = datamodule(cfg, prec.layout, trainer, datamodules)
    module = build.module(cfg, dm.num_classes, prec.layout)
    net = module.net.to(device)
    optimizer = instantiate(module.hparams.optimizer, params=net.parameters())
    steps = sizes.warmup + sizes.timed
    scheduler = module.hparams.scheduler and instantiate(
        module.hparams.scheduler, optimizer=optimizer, total_steps=steps
    )
    step = Step(net, optimizer, scheduler, prec.name, module.hparams.label_smoothing)
    loader, batches, seconds = dm.train_dataloader(), iter(()), []
    window = StepWindow(device, sizes.warmup)
    net.train()
    try:
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            window.start()  # synchronises on CUDA
            start = time.perf_counter()
            step(*batch)
            _sync(device)
            seconds.append(time.perf_counter() - start)
            window.stop()
    except torch.OutOfMemoryError:
        return {"skipped": "out of memory"}
    return _measured(seconds, window, cfg.data.batch_size, device)


# -- the sections: each `fn(ctx, keep)`, in a process of its own ------------------------------
@dataclass
class Context:
    """What every section gets. `deadline`: time.time() by which its process is killed."""

    sizes: Sizes
    data_dir: Path  # the timing data (`images` of them)
    source: str | None  # --data-dir
    work: Path
    device: str
    deadline: float
    tests: str = "none"
    airbench: str | None = None

    def left(self) -> float:
        return self.deadline - time.time()


def case_overrides(sizes: Sizes, data_dir: Path, run_dir: Path, device: str) -> list[str]:
    """A run of the template's default config that only trains (timed steps, no writes)."""
    return [
        *sizes.model,
        f"data.data_dir={data_dir}",
        "data.download=false",
        f"data.batch_size={sizes.batch}",
        "data.val_split=0",
        *(["trainer=cpu"] if device == "cpu" else ["trainer.accelerator=gpu", "trainer.devices=1"]),
        f"trainer.max_steps={sizes.warmup + sizes.timed}",
        "trainer.max_epochs=-1",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "callbacks.model_checkpoint=null",
        "callbacks.last_checkpoint=null",
        "callbacks.step_checkpoint=null",
        "logger=none",
        "test=false",
        f"run_dir={run_dir}",
    ]


def precision_section(ctx: Context, keep) -> list:
    sizes, rows, dms = ctx.sizes, [], {}
    for case in sizes.modes:
        name, layout = case.split()
        run_dir = ctx.work / case.replace(" ", "-")
        cfg = compose(
            [
                *case_overrides(sizes, ctx.data_dir, run_dir, ctx.device),
                *dict(MODES)[name],
                f"precision.channels_last={str(layout == 'cl').lower()}",
            ]
        )
        _log(f"precision: {case}")
        row = {"mode": name, "channels_last": layout == "cl"}
        row["lightning"] = lightning_steps(cfg, sizes, dms)
        _release()
        row["plain"] = plain_steps(cfg, sizes, dms)
        _release()
        rows.append(row)
        keep(rows)
    return rows


def checkpointing_section(ctx: Context, keep) -> list:
    """16-mixed in its default layout, with each checkpointing setting."""
    sizes, rows, dms = ctx.sizes, [], {}
    every = f"[{','.join(map(str, range(sizes.stages)))}]"
    for label in sizes.checkpointing:
        overrides = [o.replace("ALL", every) for o in CHECKPOINTING[label]]
        tag = "ckpt-" + label.replace(" ", "_").replace(",", "-")
        base = case_overrides(sizes, ctx.data_dir, ctx.work / tag, ctx.device)
        cfg = compose([*base, "precision=16-mixed", *overrides])
        _log(f"activation checkpointing: {label}")
        rows.append({"setting": label, **lightning_steps(cfg, sizes, dms)})
        _release()
        keep(rows)
    return rows


def auto_section(ctx: Context, keep) -> dict:
    """precision=auto's probe on the precision section's network and batch."""
    from cifar_amp import autoprecision as A
    from cifar_amp import build

    cfg = compose(
        [
            *case_overrides(ctx.sizes, ctx.data_dir, ctx.work / "auto", ctx.device),
            "precision=auto",
            f"precision.probe_seconds={ctx.sizes.probe_seconds}",
        ]
    )
    _log("precision=auto: probe")
    prec = build.precision(cfg)
    trainer = build.trainer(cfg, prec)
    dev = trainer.strategy.root_device
    dm = datamodule(cfg, prec.layout, trainer, {})
    module = build.module(cfg, dm.num_classes, prec.layout)
    names = A.candidates(dev.type, *A.capabilities(dev))
    batch = next(iter(dm.train_dataloader()))  # as the probe takes it in a run
    start = time.perf_counter()
    found = A.probe(
        module, batch, names, lambda n: prec.plugin(dev.type, n), dev, prec.probe_seconds
    )
    seconds = time.perf_counter() - start
    return {
        "candidates": names,
        "images_per_sec": {k: m.images_per_sec for k, m in found.items()},
        "finite": {k: m.finite for k, m in found.items()},
        "probe_batch": next(iter(found.values())).batch_size,
        "chosen": A.choose(found),
        "seconds": seconds,
        "budget": prec.probe_seconds,
        "channels_last": prec.layout,
    }


def framework_section(ctx: Context, keep) -> list:
    """The recipe's Lightning run against the plain loop (bench/framework.py)."""
    from bench import framework

    sizes, cases = ctx.sizes, []
    for i, (name, args) in enumerate(sizes.framework):
        _log(f"framework: {name}")
        compiled = "--compile" in args
        argv = [
            *args,
            "--device",
            ctx.device,
            "--fused",
            "--n-images",
            str(sizes.images),
            # compiling is the slow part: one timed round of one epoch
            "--epochs",
            str(1 if compiled else sizes.framework_epochs),
            "--repeats",
            str(1 if compiled else sizes.framework_repeats),
            "--warmup-rounds",
            str(sizes.warmup_rounds),
        ]
        report = framework.compare(framework.parse(argv), ctx.work / f"framework{i}", ctx.data_dir)
        cases.append({"case": name, "argv": argv, **report})
        _release()
        keep(cases)
    return cases


def host_section(ctx: Context, keep) -> dict:
    """A step of the recipe at a tiny width, where it is host work; and where it goes."""
    from bench import framework, host_work

    sizes = ctx.sizes
    argv = ["--device", ctx.device, "--widths", "4,4,4", "--batch-size", "8", "--epochs", "1"]
    argv += ["--n-images", str(sizes.host_images), "--warmup-rounds", str(sizes.warmup_rounds)]
    if ctx.device == "cuda":  # the recipe's precision and optimizer
        argv += ["--precision", "bf16-mixed", "--fused"]
    argv += ["--data-dir", ctx.source] if ctx.source else []
    _log("host work per step")
    args = framework.parse([*argv, "--repeats", str(sizes.host_repeats)])
    timed = {"argv": argv, **framework.compare(args, ctx.work / "host")}
    keep(timed)
    _log("host work: profile")
    profiled = host_work.profile(framework.parse(argv), ctx.work / "host_profile", top=5)
    return timed | {"profile": profiled}


def speedrun_section(ctx: Context, keep) -> dict:
    """`train.py experiment=speedrun_gpu`, in a fresh process as a user runs it (the dry run:
    the same config, trained in this process); then airbench94 on the same images."""
    run_dir = ctx.work / "speedrun_gpu"
    overrides = [
        "experiment=speedrun_gpu",
        f"data.data_dir={ctx.data_dir}",
        "data.download=false",
        *ctx.sizes.speedrun,
    ]
    command = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    _log("train.py experiment=speedrun_gpu")
    start = time.perf_counter()
    result = {"command": " ".join(command[1:])}
    if ctx.sizes.fresh_process:
        timeout = ctx.left() * (0.7 if ctx.airbench else 1.0)  # airbench94 needs about 20 s
        try:
            out = subprocess.run(
                command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
            )
            if out.returncode != 0:
                tail = (out.stderr or out.stdout).strip().splitlines()[-1:]
                result["failed"] = tail
        except subprocess.TimeoutExpired:
            result["failed"] = f"did not finish in {timeout:.0f} s"
    else:
        from cifar_amp.training import train

        train(compose([*overrides, f"run_dir={run_dir}"]))
    if "failed" not in result:
        found = json.loads((run_dir / "metrics.json").read_text())
        keys = ("epochs", "train_seconds", "compile_seconds", "fit_seconds", "test/acc")
        result |= {k: found.get(k) for k in (*keys, "precision")}
    result["seconds"] = time.perf_counter() - start
    keep(result)
    result["airbench94"] = airbench(ctx) if ctx.airbench else {"skipped": "no --airbench"}
    return result


def airbench(ctx: Context) -> dict:
    """The public airbench94 script on the timing data, in its own folder (it reads
    `cifar10/{train,test}.pt` there); stopped after AIRBENCH_RUNS runs or at the deadline."""
    import torch

    from bench.synthetic import SPEC

    if ctx.device != "cuda":
        return {"skipped": "airbench94 needs CUDA"}
    folder = ctx.work / "airbench"
    (folder / "cifar10").mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        x, y = SPEC.read(SPEC.find(ctx.data_dir), split)
        images = x.permute(0, 2, 3, 1).contiguous()  # NHWC uint8, as torchvision gives them
        saved = {"images": images, "labels": y, "classes": list(SPEC.classes)}
        torch.save(saved, folder / "cifar10" / f"{split}.pt")
    _log(f"airbench94: {ctx.airbench}")
    command = [sys.executable, str(Path(ctx.airbench).resolve())]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:  # one line an epoch: the deadline is checked often enough
            lines.append(line)
            if "eval" in line and sum("eval" in x for x in lines) >= AIRBENCH_RUNS:
                break
            if ctx.left() < 2:
                break
    finally:
        proc.kill()
        proc.wait()
    return {"command": " ".join(command[1:])} | airbench_epochs("".join(lines))


def airbench_epochs(text: str) -> dict:
    """airbench94's seconds per epoch from its table (the `total_time_seconds` column, training
    time only, cumulative within a run): the median over its runs after the first (warm-up)."""
    runs: list[list[float]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not re.fullmatch(r"\d+", cells[1]):
            continue
        if cells[0]:  # a run's first epoch names the run
            runs.append([])
        if runs:
            runs[-1].append(float(cells[6]))
    timed = [r for r in runs[1:] if len(r) > 1]
    per_epoch = [(r[-1] - r[0]) / (len(r) - 1) for r in timed]
    return {
        "runs": len(runs),
        "epochs": [len(r) for r in runs],
        "seconds_per_epoch": statistics.median(per_epoch) if per_epoch else None,
    }


def tests_section(ctx: Context, keep) -> dict:
    """`pytest -m gpu` and the default suite, each with its summary line."""
    out = {}
    suites = {"gpu": ["-m", "gpu"], "default": []}
    for name, args in suites.items():
        which = ctx.tests
        if which == "none" or (which == "gpu" and name == "default"):
            out[name] = {"summary": f"not run (--tests {which})"}
            continue
        if importlib.util.find_spec("pytest") is None:
            out[name] = {"summary": "not run: pytest is not installed"}
            continue
        workers = ["-n", "8"] if name == "default" and importlib.util.find_spec("xdist") else []
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *workers]
        timeout = ctx.left() - 2
        if timeout <= 0:
            out[name] = {"summary": "not run: no time left", "passed": False}
            continue
        _log(f"pytest {' '.join(args + workers) or '(default suite)'}, at most {timeout:.0f} s")
        start = time.perf_counter()
        try:
            run = subprocess.run(
                command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
            )
            summary = summary_line(run.stdout) or f"exit {run.returncode}, no summary line"
            ran = re.search(r"\d+ (passed|failed)", summary)  # not all skipped or none collected
            ok = (run.returncode == 0) if ran else None
        except subprocess.TimeoutExpired as e:
            tail = summary_line(
                e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            )
            summary = f"did not finish in {timeout:.0f} s" + (f" ({tail})" if tail else "")
            ok = False
        out[name] = {
            "command": " ".join(command[1:]),
            "summary": summary,
            "passed": ok,
            "seconds": time.perf_counter() - start,
        }
        keep(out)
    return out


RUNS = {
    "precision": precision_section,
    "checkpointing": checkpointing_section,
    "auto": auto_section,
    "framework": framework_section,
    "host": host_section,
    "speedrun": speedrun_section,
    "tests": tests_section,
}


def summary_line(text: str) -> str | None:
    """pytest's last line (`=== 3 passed, 1 skipped in 2.1s ===`), without the equals signs."""
    for line in reversed((text or "").strip().splitlines()):
        if re.search(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b", line):
            return line.strip(" =")
    return None


def _env() -> dict:
    # The subprocesses import this checkout, not an installed copy of the package.
    paths = [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")]
    return os.environ | {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


T0 = time.perf_counter()


def _log(text: str) -> None:
    print(f"[bench-gpu {time.perf_counter() - T0:6.1f} s] {text}", file=sys.stderr, flush=True)


# -- running the sections within the budget -----------------------------------------------------
def run_sections(jobs: list, budget: float, data: dict, save, folder: Path, start_method: str):
    """Run each job (name, share, fn, arg) as `fn(arg, keep)` in a process of its own (started
    by `start_method`: CUDA cannot be forked; a fork starts in a blink, imports done), given
    `share` / (the shares left) of what is left of `budget` seconds; `save(data)` after each.
    `arg` may be a Context, whose deadline is set here. A job still running at its deadline is
    killed (its process group: its own subprocesses too) and recorded in `data["cut"]`, with
    what it passed to `keep` so far as its result; one that raised, in `data["failed"]`."""
    start = time.perf_counter()
    shares = sum(share for _, share, *_ in jobs)
    for name, share, fn, arg in jobs:
        limit = max(0.0, budget - (time.perf_counter() - start)) * share / shares
        shares -= share
        if isinstance(arg, Context):
            arg.deadline = time.time() + limit
        began = time.perf_counter()
        result, status = _in_child(fn, arg, folder / f"{name}.json", limit, start_method)
        took = time.perf_counter() - began
        if result is not None:
            data[name] = result
        data.setdefault("section_seconds", {})[name] = round(took, 1)
        if status == "cut":
            data.setdefault("cut", {})[name] = f"cut by the deadline after {took:.0f} s"
        elif status != "done":
            data.setdefault("failed", {})[name] = status
        save(data)


def _in_child(fn, arg, path: Path, limit: float, method: str) -> tuple[object, str]:
    """(what the child kept or returned, "done" | "cut" | why it failed)."""
    import multiprocessing

    path.unlink(missing_ok=True)
    proc = multiprocessing.get_context(method).Process(target=_child, args=(fn, arg, path))
    proc.start()
    try:
        proc.join(limit)
    finally:  # also when this process is told to stop (SIGTERM: see main)
        cut = proc.is_alive()
        if cut:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # before its setpgrp
                proc.kill()
            proc.join()
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if cut:
        return saved.get("result"), "cut"
    return saved.get("result"), saved.get("status", f"exit code {proc.exitcode}, no result")


def _child(fn, arg, path: Path) -> None:
    os.setpgrp()  # a group of its own: killing it kills its subprocesses (train.py, pytest)
    if getattr(arg, "device", None) == "cpu":
        # Tiny networks: a second thread's waits on a busy CPU cost more than it adds; and one
        # thread is what makes torch safe in a forked process (as in a DataLoader worker).
        import torch

        torch.set_num_threads(1)

    def keep(result, status="partial") -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"status": status, "result": result}, default=str))
        os.replace(tmp, path)  # a kill mid-write leaves the previous version

    try:
        keep(fn(arg, keep), "done")
    except BaseException as e:
        keep(json.loads(path.read_text())["result"] if path.is_file() else None, repr(e)[:300])
        raise


# -- the table ------------------------------------------------------------------------------
def _fmt(value, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def _holds(ok) -> str:
    return "-" if ok is None else ("yes" if ok else "no")


def rows(data: dict) -> list[tuple[str, str, str]]:
    """(target, measured, holds) for every promise; `holds` is "-" where nothing was measured.
    A section cut by the deadline (or failed) has a row saying so, after its finished cases."""
    out = []
    for name in SECTIONS:
        if name in data or name in data.get("cut", {}) or name in data.get("failed", {}):
            out += ROWS[name](data) if name in data else []
            if name in data.get("cut", {}):
                out.append((f"`{name}` ends within its share of --budget", data["cut"][name], "no"))
            if name in data.get("failed", {}):
                out.append((f"`{name}` runs", f"failed: {data['failed'][name]}", "no"))
    return out


def _precision_rows(data: dict) -> list:
    out = []
    model, batch = data["sizes"]["net"], data["sizes"]["batch"]
    prec = {(r["mode"], r["channels_last"]): r for r in data["precision"]}
    for (mode, cl), r in prec.items():
        lt, pl = r["lightning"], r["plain"]
        layout = "channels_last" if cl else "NCHW"
        target = (
            f"{model} b{batch} {mode} {layout}: template >= {TEMPLATE_RATIO} x plain loop, img/s"
        )
        if "skipped" in lt or "skipped" in pl:
            out.append((target, f"skipped: {lt.get('skipped') or pl.get('skipped')}", "-"))
            continue
        ratio = lt["images_per_sec"] / pl["images_per_sec"]
        out.append(
            (
                target,
                f"template {_fmt(lt['images_per_sec'])} img/s, step peak "
                f"{_fmt(lt.get('step_peak_mb'))} MB; plain {_fmt(pl['images_per_sec'])} img/s, "
                f"{_fmt(pl.get('step_peak_mb'))} MB; ratio {ratio:.2f}",
                _holds(ratio >= TEMPLATE_RATIO),
            )
        )

    def get(loop, mode, cl, key):
        return prec.get((mode, cl), {}).get(loop, {}).get(key)

    speed = {k: get("lightning", *k, "images_per_sec") for k in prec}
    plain = {k: get("plain", *k, "images_per_sec") for k in prec}
    mixed = {k: v for k, v in speed.items() if v and k[0] in ("16-mixed", "bf16-mixed")}
    best = max(mixed, key=mixed.get) if mixed else None
    ref = max((k for k in plain if plain[k]), key=plain.get, default=None)
    gain = mixed[best] / plain[ref] if best and ref else None
    out.append(
        (
            f"mixed precision pays: the template's best 16-bit mode >= {BEST_16BIT} x the plain "
            "loop's best mode, img/s",
            f"{_case(best)} {_fmt(mixed[best])} vs plain {_case(ref)} {_fmt(plain[ref])} "
            f"({gain:.2f})"
            if gain
            else "-",
            _holds(gain >= BEST_16BIT if gain else None),
        )
    )
    ratios = {}
    for mode, cl in prec:
        fp32 = get("lightning", "32-true", cl, "step_peak_mb")
        mine = get("lightning", mode, cl, "step_peak_mb")
        if mode in ("16-mixed", "bf16-mixed") and fp32 and mine:
            ratios[(mode, cl)] = mine / fp32
    out.append(
        (
            f"16-bit modes' step peak memory <= {MIXED_MEMORY} x 32-true's (same layout), template",
            "; ".join(f"{_case(k)} {v:.2f}" for k, v in ratios.items()) or "-",
            _holds(max(ratios.values()) <= MIXED_MEMORY if ratios else None),
        )
    )
    checks = []
    for mode in ("32-true", "16-mixed", "bf16-mixed"):
        faster = {cl: speed.get((mode, cl)) for cl in (False, True)}
        if None in faster.values() or mode not in data["defaults"]:
            continue
        default = data["defaults"][mode]
        checks.append((mode, default, faster[default] * LAYOUT_SLACK >= max(faster.values())))
    out.append(
        (
            f"each mode's default layout is its faster one (within {LAYOUT_SLACK - 1:.0%})",
            ", ".join(
                f"{m}: {'channels_last' if d else 'NCHW'} {'ok' if ok else 'slower'}"
                for m, d, ok in checks
            )
            or "-",
            _holds(all(ok for *_, ok in checks) if checks else None),
        )
    )
    return out


def _case(key) -> str:
    return f"{key[0]} {'channels_last' if key[1] else 'NCHW'}" if key else "-"


def _checkpointing_rows(data: dict) -> list:
    ckpt = [r for r in data["checkpointing"] if r.get("step_peak_mb")]
    none = next((r for r in ckpt if r["setting"] == "none"), None)
    target = f"activation checkpointing, best setting: step peak memory <= {CKPT_MEMORY} x none's"
    others = [r for r in ckpt if r is not none]
    if not none or not others:
        return [(target, "-", "-")]
    best = min(others, key=lambda r: r["step_peak_mb"])
    mem, slower = best["step_peak_mb"] / none["step_peak_mb"], best["step_ms"] / none["step_ms"]
    measured = (
        f"{best['setting']}: {_fmt(best['step_peak_mb'])} vs {_fmt(none['step_peak_mb'])} MB "
        f"({mem:.2f}), {best['step_ms']:.1f} vs {none['step_ms']:.1f} ms ({slower:.2f} x)"
    )
    return [(target, measured, _holds(mem <= CKPT_MEMORY))]


def _auto_rows(data: dict) -> list:
    auto, batch = data["auto"], data["sizes"]["batch"]
    cl = auto["channels_last"]
    table = {}
    for r in data.get("precision", []):
        if r["channels_last"] == cl and r["mode"] in auto["candidates"]:
            table[r["mode"]] = r["lightning"].get("images_per_sec")
    finite = [m for m in table if table[m] and auto["finite"].get(m)]
    fastest = max(finite, key=table.get) if finite else None
    agrees = table.get(auto["chosen"]) or 0
    ok = agrees >= AUTO_WITHIN * table[fastest] if fastest else None
    probed = ", ".join(f"{m} {_fmt(v)}" for m, v in auto["images_per_sec"].items())
    return [
        (
            f"precision=auto: probes at the run's batch ({batch}) within its budget and picks a "
            f"mode within {1 - AUTO_WITHIN:.0%} of the fastest finite one of the table above",
            f"{auto['chosen']} in {auto['seconds']:.1f} s at batch {auto.get('probe_batch')} "
            f"(probe img/s: {probed}; table's fastest: {fastest})",
            _holds(
                None
                if ok is None
                else ok
                and auto["seconds"] <= auto["budget"] + 2
                and auto.get("probe_batch") == batch
            ),
        )
    ]


def _framework_rows(data: dict) -> list:
    out = []
    for case in data["framework"]:
        target = f"Lightning / plain >= {RATIO}: {case['case']}"
        if "skipped" in case:
            out.append((target, f"not run ({case['skipped']})", "-"))
            continue
        ratio = case["ratio_lightning_over_plain"]
        out.append(
            (
                target,
                f"plain {_fmt(case['plain_images_per_s'])} img/s, Lightning "
                f"{_fmt(case['lightning_images_per_s'])} img/s ({ratio:.3f}); "
                f"Lightning {case['lightning_s_per_epoch']:.3f} s/epoch",
                _holds(ratio >= RATIO),
            )
        )
    return out


def _host_rows(data: dict) -> list:
    host = data["host"]
    ms = host["ms_per_step"]
    extra = host["lightning_extra_ms_per_step"]
    return [
        (
            f"host work of a recipe step (Lightning, module, every callback) <= "
            f"{HOST_STEP_MS} ms (airbench94's H100 step at batch 1024)",
            f"{ms['lightning']:.2f} ms (plain loop {ms['plain']:.2f} ms; tiny net)",
            _holds(ms["lightning"] <= HOST_STEP_MS),
        ),
        (
            f"Lightning's extra host work per step <= {HOST_EXTRA_MS} ms",
            f"{extra:.2f} ms",
            _holds(extra <= HOST_EXTRA_MS),
        ),
    ]


def _speedrun_rows(data: dict) -> list:
    run, images = data["speedrun"], data["sizes"]["images"]
    if "failed" in run:
        return [("experiment=speedrun_gpu runs", f"failed: {run['failed']}", "no")]
    train, fit, epochs = run.get("train_seconds"), run.get("fit_seconds"), run.get("epochs")
    per_epoch = train / epochs if train and epochs else None
    theirs = run.get("airbench94", {})
    their_epoch = theirs.get("seconds_per_epoch")
    if their_epoch:
        versus = f"airbench94 {their_epoch:.3f} s ({theirs['runs']} runs, the first a warm-up)"
    else:
        versus = f"airbench94 not run ({theirs.get('skipped', 'no time left')})"
    return [
        (
            f"experiment=speedrun_gpu: an epoch of {images:,} images <= airbench94's, same GPU "
            "and images",
            f"{_fmt(per_epoch, ' s', 3)} (train_seconds {_fmt(train, '', 2)} / {epochs} epochs); "
            f"{versus}",
            _holds(per_epoch <= their_epoch if per_epoch and their_epoch else None),
        ),
        (
            f"speedrun_gpu: fit_seconds (compile included) <= {FIT_OVER_TRAIN} x train_seconds",
            f"fit {_fmt(fit, ' s', 2)}, train {_fmt(train, ' s', 2)}, compile "
            f"{_fmt(run.get('compile_seconds'), ' s', 2)}",
            _holds(fit <= FIT_OVER_TRAIN * train if fit and train else None),
        ),
    ]


def _tests_rows(data: dict) -> list:
    out = []
    for name, label in (("gpu", "`pytest -m gpu`"), ("default", "the default test suite")):
        t = data["tests"].get(name)
        if t is None:
            continue
        within = f" in <= {GPU_TESTS_S:.0f} s" if name == "gpu" else ""
        ok = t.get("passed")
        if ok and name == "gpu":
            ok = t["seconds"] <= GPU_TESTS_S
        out.append((f"{label} passes on this machine{within}", t["summary"], _holds(ok)))
    return out


ROWS = {
    "precision": _precision_rows,
    "checkpointing": _checkpointing_rows,
    "auto": _auto_rows,
    "framework": _framework_rows,
    "host": _host_rows,
    "speedrun": _speedrun_rows,
    "tests": _tests_rows,
}


def markdown(data: dict) -> str:
    """The record: header, the table, the details, the chart and the raw JSON."""
    from bench import report

    m = data["machine"]
    if m["gpu"]:
        head = f"**{m['gpu']}**, driver {m['driver'] or '?'}, CUDA {m['cuda']}, cuDNN {m['cudnn']}"
    else:
        head = "**not a GPU**: a CPU dry run at tiny sizes (the figures say nothing about a GPU)"
    lines = [
        f"### `make bench-gpu`, {m['date']}\n",
        f"{head}; torch {m['torch']}, Lightning {m['lightning']}, torchmetrics "
        f"{m['torchmetrics']}, torchvision {m['torchvision']}, hydra-core {m['hydra-core']}, "
        f"Python {m['python']}; {m['cpu_cores']} CPU cores; commit {m['commit']}"
        f"{' (with uncommitted changes)' if m['dirty'] else ''}. Took {data['seconds']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in data.get("section_seconds", {}).items())
        + f"). Data: {data['images']}.\n",
    ]
    if data["missing"]:
        lines.append(f"Missing: {', '.join(data['missing'])}.\n")
    lines.append("\n" + report.markdown(["target", "measured", "holds"], rows(data)))
    lines.append("\n" + details(data))
    if data.get("chart"):
        lines.append(f"\n![bench-gpu chart]({data['chart']})\n")
    elif data.get("chart_note"):
        lines.append(f"\nChart: {data['chart_note']}.\n")
    raw = json.dumps(data, indent=1, default=str)
    lines.append(f"\n<details><summary>raw JSON</summary>\n\n```json\n{raw}\n```\n\n</details>\n")
    return "".join(lines)


def details(data: dict) -> str:
    from bench import report

    text = []
    prec = data.get("precision", [])
    if prec:
        text.append(
            "Precision modes (median step after warm-up). Memory, each timed step in a window of "
            "its own (device synchronised; the batch already fetched): `step` is the step's own "
            "peak, what it adds over what was allocated at its start; `base` that start (the "
            "data kept on the device, weights, gradients, optimizer state); `all` the highest "
            "peak of everything allocated. MB; on CPU `all` is the process's peak RSS:\n\n"
        )
        table = []
        for r in prec:
            lt, pl = r["lightning"], r["plain"]
            keys = ("images_per_sec", "step_ms", "step_peak_mb", "base_mb", "peak_mb")
            table.append(
                [r["mode"], "channels_last" if r["channels_last"] else "NCHW"]
                + [loop.get(k) for k in keys for loop in (lt, pl)]
            )
        cols = ["img/s", "ms", "step MB", "base MB", "all MB"]
        both = [f"{who} {c}" for c in cols for who in ("template", "plain")]
        text.append(report.markdown(["mode", "layout", *both], table))
    ckpt = data.get("checkpointing", [])
    if ckpt:
        text.append("\nActivation checkpointing (16-mixed, template):\n\n")
        keys = ("step_ms", "step_peak_mb", "base_mb", "peak_mb", "skipped")
        table = [[r["setting"], *(r.get(k) for k in keys)] for r in ckpt]
        cols = ["setting", "step ms", "step MB", "base MB", "all MB", "note"]
        text.append(report.markdown(cols, table))
    host = data.get("host", {}).get("profile")
    if host:
        text.append(
            "\nHost work of a step by owner (cProfile, microseconds per step; inflates Python "
            "against torch ops):\n\n"
        )
        by = host["us_per_step_by_owner"]
        lightning = by["lightning"].get("total", by["lightning"])
        owners = list(dict.fromkeys([*lightning, *by["plain"]]))
        table = [[o, by["plain"].get(o), lightning.get(o)] for o in owners]
        text.append(report.markdown(["owner", "plain", "Lightning (recipe)"], table))
    return "".join(text)


def chart(data: dict, path: Path) -> str | None:
    """The chart, or why there is none."""
    if importlib.util.find_spec("matplotlib") is None:
        return "not drawn: matplotlib is not installed"
    from bench import report

    prec = data.get("precision", [])
    labels = [f"{r['mode']} {'CL' if r['channels_last'] else 'NCHW'}" for r in prec]
    panels = [
        (
            "precision modes: images/s",
            {
                loop: [r[loop].get("images_per_sec") for r in prec]
                for loop in ("lightning", "plain")
            },
        ),
        (
            "precision modes: peak memory (MB)",
            {loop: [r[loop].get("peak_mb") for r in prec] for loop in ("lightning", "plain")},
        ),
    ]
    report.grouped_bars(path, labels, panels)
    return None


def write_record(doc: Path, text: str) -> None:
    """Replace the doc's record section (between the markers) with `text`; append the
    section where the markers are missing."""
    old = doc.read_text() if doc.is_file() else ""
    block = f"{START}\n{text}{END}"
    if START in old and END in old:
        new = old[: old.index(START)] + block + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip("\n") + "\n\n## Record (`make bench-gpu`)\n\n" + block + "\n"
    doc.write_text(new)


# -- the command ------------------------------------------------------------------------------
def run(args, out: Path) -> dict:
    """Every section of `args.sections` (bench_gpu.{json,md} in `out` rewritten after each)."""
    import torch

    from bench import synthetic

    start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    sizes = Sizes.gpu() if cuda else Sizes.tiny()
    work = Path(tempfile.mkdtemp(prefix="work_", dir=out))
    data_dir, images = synthetic.write(
        work / "data", sizes.images, sizes.images // 5, args.data_dir
    )
    data = {
        "machine": machine(cuda),
        "missing": missing()[1],
        "sizes": asdict(sizes),
        "images": images,
        "budget": args.budget,
        "defaults": {},
    }
    from cifar_amp.precision import Precision

    for mode in ("32-true", "16-mixed", "bf16-mixed"):
        data["defaults"][mode] = Precision(mode).channels_last(device)

    def save(data: dict) -> None:
        data["seconds"] = time.perf_counter() - start
        (out / "bench_gpu.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (out / "bench_gpu.md").write_text(markdown(data))

    jobs = []
    for name in (s for s in SECTIONS if s in args.sections):
        ctx = Context(sizes, data_dir, args.data_dir, work, device, 0.0, args.tests, args.airbench)
        jobs.append((name, SHARES[name], RUNS[name], ctx))
    left = args.budget - RESERVE_S - (time.perf_counter() - start)
    (out / "sections").mkdir(exist_ok=True)
    run_sections(jobs, left, data, save, out / "sections", "spawn" if cuda else "fork")
    save(data)
    shutil.rmtree(work, ignore_errors=True)
    return data


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--data-dir", help="a CIFAR-10 folder: its images, repeated (else random)")
    ap.add_argument("--out", help="output folder (default logs/bench_gpu/<time>)")
    ap.add_argument(
        "--doc",
        type=Path,
        help=f"the doc whose record section is rewritten (default on CUDA: {DOC.relative_to(REPO)})",
    )
    ap.add_argument("--no-doc", action="store_true", help="write no doc")
    ap.add_argument("--tests", default="all", choices=["all", "gpu", "none"])
    ap.add_argument(
        "--budget", type=float, default=600, help="seconds for everything, every section included"
    )
    ap.add_argument(
        "--airbench", help="airbench94.py (legacy/): run beside experiment=speedrun_gpu"
    )
    ap.add_argument(
        "--tiny", action="store_true", help="the dry run's sizes, on CPU, even with CUDA"
    )
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        type=lambda text: text.split(","),
        help=f"a comma-separated subset of {','.join(SECTIONS)} (a rerun of what fell short)",
    )
    args = ap.parse_args(argv)
    if unknown := set(args.sections) - set(SECTIONS):
        ap.error(f"--sections: {', '.join(sorted(unknown))}; valid: {', '.join(SECTIONS)}")
    need, nice = missing()
    print("bench-gpu: every GPU promise of the template, one table")
    if need:
        print(
            f"missing: {', '.join(need)}: cannot run (install them; Hydra's wheels: make bench-gpu WHEELS=<folder>)"
        )
        raise SystemExit(2)
    print(f"missing: {', '.join(nice)}" if nice else "missing: nothing")
    import torch

    if not torch.cuda.is_available() or args.tiny:
        print(
            "not a GPU: a dry run of the same code at tiny sizes (its figures say nothing about a GPU)"
        )
    out = Path(args.out or REPO / "logs" / "bench_gpu" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    out.mkdir(parents=True, exist_ok=True)
    # Told to stop (`timeout`, a job's end): unwind, so that the running section is killed too.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        data = run(args, out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    doc = None if args.no_doc else args.doc or (DOC if data["machine"]["gpu"] else None)
    picture = (doc.parent if doc else out) / (doc.stem + ".png" if doc else "bench_gpu.png")
    data["chart_note"] = chart(data, picture)
    data["chart"] = None if data["chart_note"] else picture.name
    text = markdown(data)
    (out / "bench_gpu.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out / "bench_gpu.md").write_text(text)
    if doc is not None:
        write_record(doc, text)
    print()
    from bench import report

    print(report.markdown(["target", "measured", "holds"], rows(data)))
    where = f"{out}/bench_gpu.{{md,json}}" + (f" and the record section of {doc}" if doc else "")
    print(f"wrote {where}")
    return data


if __name__ == "__main__":
    main()
