"""`make bench-gpu` (`python -m bench.gpu`): every GPU promise of the template, measured in one
command, as one table: target | measured | holds.

    python -m bench.gpu [--data-dir <CIFAR-10 folder>] [--tests all|gpu|none] [--budget 600]

On a CUDA machine (meant to take at most 10 minutes on one H100) it measures:
- precision modes on ResNet-18, batch 512: strict fp32 (TF32 off), 32-true (TF32),
  16-mixed, bf16-mixed, each NCHW and channels_last: images/s and peak memory of the
  template's training step (Lightning, the default callbacks) against the plain PyTorch loop's
  (bench/reference_loop.py) for the same set-up: what the hardware gives;
- activation checkpointing: each stage setting's peak memory and step time against none;
- precision=auto: its probe's choice and time, checked against the modes' measured speed;
- the Lightning loop against the plain loop (bench/framework.py: the run experiment=
  speedrun_gpu builds, every callback) for SpeedNet 64,256,256 batch 1024 bf16-mixed and
  ResNet-18 batch 512 16-mixed, each without and with torch.compile;
- host work per step: the same comparison at a tiny width (SpeedNet 4,4,4, batch 8), where
  a step is host work, and where its time goes (bench/host_work.py);
- `train.py experiment=speedrun_gpu` on 50,000 training images (those of `--data-dir`
  repeated, or random pixels: speed does not depend on them) in a fresh process: seconds per
  epoch, train_seconds, compile_seconds, fit_seconds;
- `pytest -m gpu` and the default suite on this machine, their summary lines.
then prints the table and writes it, with the raw JSON and a chart, into the record section
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
SECTIONS = ("precision", "checkpointing", "auto", "framework", "host", "speedrun", "tests")
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
# Targets (docs/benchmarks-gpu.md).
RATIO = 0.95  # Lightning / plain, images/s
MIXED_SPEEDUP = 2.0  # best 16-bit mode (channels_last) over 32-true (TF32) NCHW, template
MIXED_MEMORY = 0.6  # 16-bit modes' peak memory over 32-true's
CKPT_MEMORY, CKPT_TIME = 0.75, 1.3  # best checkpointing setting: memory and step-time ratios
HOST_STEP_MS = 4.0  # airbench94's whole GPU step at batch 1024 on an H100
HOST_EXTRA_MS = 1.0  # Lightning's extra host work per step
EPOCH_S = 0.20  # speedrun_gpu, 50,000 images
FIT_OVER_TRAIN = 2.0
OUTSIDE_TRAIN = 0.15  # (fit - train - compile) / train


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
                (
                    "ResNet-18 b512 16-mixed, compiled",
                    [*RESNET_GPU, "--channels-last", "--compile"],
                ),
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


def _peak_mb(device, reset: bool = False) -> float | None:
    import torch

    from cifar_amp.extras.diagnostics.diagnostics import peak_rss_mb

    if device.type != "cuda":
        return None if reset else peak_rss_mb()
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


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


def lightning_steps(cfg, sizes: Sizes, datamodules: dict) -> dict:
    """The template's steps: median step time and peak memory over the timed steps."""
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
    step = statistics.median(meter.seconds[sizes.warmup :])
    device = module.device
    return {
        "step_ms": 1e3 * step,
        "images_per_sec": cfg.data.batch_size / step,
        "peak_mb": meter.peak_mb if device.type == "cuda" else _peak_mb(device),
        "channels_last": bool(module.hparams.channels_last),
    }


def plain_steps(cfg, sizes: Sizes, datamodules: dict) -> dict:
    """The same set-up in the plain loop: same network and initial weights, precision, TF32
    setting, layout, optimizer, schedule and device-resident batches."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

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
    net.train()
    try:
        for i in range(steps):
            if i == sizes.warmup:
                _peak_mb(device, reset=True)
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            _sync(device)
            start = time.perf_counter()
            step(*batch)
            _sync(device)
            seconds.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        return {"skipped": "out of memory"}
    median = statistics.median(seconds[sizes.warmup :])
    return {
        "step_ms": 1e3 * median,
        "images_per_sec": cfg.data.batch_size / median,
        "peak_mb": _peak_mb(device),
    }


# -- the sections ---------------------------------------------------------------------------
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


def precision_section(sizes: Sizes, data_dir: Path, work: Path, device: str, dms: dict) -> list:
    rows = []
    for case in sizes.modes:
        name, layout = case.split()
        cfg = compose(
            [
                *case_overrides(sizes, data_dir, work / case.replace(" ", "-"), device),
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
    return rows


def checkpointing_section(sizes: Sizes, data_dir: Path, work: Path, device: str, dms: dict):
    """16-mixed in its default layout, with each checkpointing setting."""
    every = f"[{','.join(map(str, range(sizes.stages)))}]"
    rows = []
    for label in sizes.checkpointing:
        overrides = [o.replace("ALL", every) for o in CHECKPOINTING[label]]
        tag = "ckpt-" + label.replace(" ", "_").replace(",", "-")
        cfg = compose(
            [*case_overrides(sizes, data_dir, work / tag, device), "precision=16-mixed", *overrides]
        )
        _log(f"activation checkpointing: {label}")
        rows.append({"setting": label, **lightning_steps(cfg, sizes, dms)})
        _release()
    return rows


def auto_section(sizes: Sizes, data_dir: Path, work: Path, device: str, dms: dict) -> dict:
    """precision=auto's probe on the precision section's network and batch."""
    from cifar_amp import build
    from cifar_amp.extras.auto_precision import autoprecision as A

    cfg = compose(
        [
            *case_overrides(sizes, data_dir, work / "auto", device),
            "precision=auto",
            f"precision.probe_seconds={sizes.probe_seconds}",
        ]
    )
    _log("precision=auto: probe")
    prec = build.precision(cfg)
    trainer = build.trainer(cfg, prec)
    dev = trainer.strategy.root_device
    dm = datamodule(cfg, prec.layout, trainer, dms)
    module = build.module(cfg, dm.num_classes, prec.layout)
    names = A.candidates(dev.type, *A.capabilities(dev))
    batch = next(iter(dm.train_dataloader()))  # as the probe takes it in a run
    start = time.perf_counter()
    found = A.probe(
        module, batch, names, lambda n: prec.plugin(dev.type, n), dev, prec.probe_seconds
    )
    seconds = time.perf_counter() - start
    _release()
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


def framework_section(sizes: Sizes, data_dir: Path, work: Path, device: str) -> list:
    """The recipe's Lightning run against the plain loop (bench/framework.py)."""
    from bench import framework

    cases = []
    for i, (name, args) in enumerate(sizes.framework):
        _log(f"framework: {name}")
        compiled = "--compile" in args
        argv = [
            *args,
            "--device",
            device,
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
        report = framework.compare(framework.parse(argv), work / f"framework{i}", data_dir)
        cases.append({"case": name, "argv": argv, **report})
        _release()
    return cases


def host_section(sizes: Sizes, source: str | None, work: Path, device: str) -> dict:
    """A step of the recipe at a tiny width, where it is host work; and where it goes."""
    from bench import framework, host_work

    argv = ["--device", device, "--widths", "4,4,4", "--batch-size", "8", "--epochs", "1"]
    argv += ["--n-images", str(sizes.host_images), "--warmup-rounds", str(sizes.warmup_rounds)]
    if device == "cuda":  # the recipe's precision and optimizer
        argv += ["--precision", "bf16-mixed", "--fused"]
    argv += ["--data-dir", source] if source else []
    _log("host work per step")
    args = framework.parse([*argv, "--repeats", str(sizes.host_repeats)])
    timed = framework.compare(args, work / "host")
    _log("host work: profile")
    profiled = host_work.profile(framework.parse(argv), work / "host_profile", top=5)
    return {"argv": argv, **timed, "profile": profiled}


def speedrun_section(sizes: Sizes, data_dir: Path, work: Path, deadline: float) -> dict:
    """`train.py experiment=speedrun_gpu`, in a fresh process as a user runs it (the dry run:
    the same config, trained in this process)."""
    run_dir = work / "speedrun_gpu"
    overrides = [
        "experiment=speedrun_gpu",
        f"data.data_dir={data_dir}",
        "data.download=false",
        *sizes.speedrun,
    ]
    command = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    _log("train.py experiment=speedrun_gpu")
    start = time.perf_counter()
    result = {"command": " ".join(command[1:])}
    if sizes.fresh_process:
        timeout = max(300.0, deadline - start)
        try:
            out = subprocess.run(
                command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return result | {"failed": f"did not finish in {timeout:.0f} s", "seconds": timeout}
        if out.returncode != 0:
            tail = (out.stderr or out.stdout).strip().splitlines()[-1:]
            return result | {"failed": tail, "seconds": time.perf_counter() - start}
    else:
        from cifar_amp.training import train

        train(compose([*overrides, f"run_dir={run_dir}"]))
    found = json.loads((run_dir / "metrics.json").read_text())
    keys = ("epochs", "train_seconds", "compile_seconds", "fit_seconds", "test/acc", "precision")
    return result | {k: found.get(k) for k in keys} | {"seconds": time.perf_counter() - start}


def tests_section(which: str, deadline: float) -> dict:
    """`pytest -m gpu` and the default suite, each with its summary line."""
    out = {}
    suites = {"gpu": ["-m", "gpu"], "default": []}
    for name, args in suites.items():
        if which == "none" or (which == "gpu" and name == "default"):
            out[name] = {"summary": f"not run (--tests {which})"}
            continue
        if importlib.util.find_spec("pytest") is None:
            out[name] = {"summary": "not run: pytest is not installed"}
            continue
        workers = ["-n", "8"] if name == "default" and importlib.util.find_spec("xdist") else []
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *workers]
        timeout = max(60.0, deadline - time.perf_counter())
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
            summary, ok = (
                f"did not finish in {timeout:.0f} s" + (f" ({tail})" if tail else ""),
                False,
            )
        out[name] = {
            "command": " ".join(command[1:]),
            "summary": summary,
            "passed": ok,
            "seconds": time.perf_counter() - start,
        }
    return out


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


# -- the table ------------------------------------------------------------------------------
def _fmt(value, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def _holds(ok) -> str:
    return "-" if ok is None else ("yes" if ok else "no")


def rows(data: dict) -> list[tuple[str, str, str]]:
    """(target, measured, holds) for every promise; `holds` is "-" where nothing was measured."""
    out = []
    model, batch = data["sizes"]["net"], data["sizes"]["batch"]
    prec = {(r["mode"], r["channels_last"]): r for r in data.get("precision", [])}
    for (mode, cl), r in prec.items():
        lt, pl = r["lightning"], r["plain"]
        layout = "channels_last" if cl else "NCHW"
        target = f"{model} b{batch} {mode} {layout}: template >= {RATIO} x plain loop, images/s"
        if "skipped" in lt or "skipped" in pl:
            out.append((target, f"skipped: {lt.get('skipped') or pl.get('skipped')}", "-"))
            continue
        ratio = lt["images_per_sec"] / pl["images_per_sec"]
        out.append(
            (
                target,
                f"template {_fmt(lt['images_per_sec'])} img/s, {_fmt(lt['peak_mb'])} MB; "
                f"plain {_fmt(pl['images_per_sec'])} img/s, {_fmt(pl['peak_mb'])} MB; "
                f"ratio {ratio:.2f}",
                _holds(ratio >= RATIO),
            )
        )

    def speed(mode, cl):
        return prec.get((mode, cl), {}).get("lightning", {}).get("images_per_sec")

    def memory(mode, cl):
        return prec.get((mode, cl), {}).get("lightning", {}).get("peak_mb")

    if prec:
        base = speed("32-true", False)
        mixed = {m: speed(m, True) for m in ("16-mixed", "bf16-mixed") if speed(m, True)}
        best = max(mixed, key=mixed.get) if mixed else None
        gain = mixed[best] / base if best and base else None
        out.append(
            (
                f"mixed precision pays: best 16-bit mode (channels_last) >= {MIXED_SPEEDUP} x "
                "32-true (TF32, NCHW), template images/s",
                f"{best} {gain:.2f} x" if gain else "-",
                _holds(gain >= MIXED_SPEEDUP if gain else None),
            )
        )
        fp32 = memory("32-true", False)
        mems = {m: memory(m, True) for m in ("16-mixed", "bf16-mixed") if memory(m, True)}
        worst = max(mems.values()) / fp32 if mems and fp32 else None
        out.append(
            (
                f"16-bit modes' peak memory <= {MIXED_MEMORY} x 32-true's",
                "; ".join(f"{m} {v / fp32:.2f}" for m, v in mems.items()) if worst else "-",
                _holds(worst <= MIXED_MEMORY if worst else None),
            )
        )
        checks = []
        for mode in ("32-true", "16-mixed", "bf16-mixed"):
            faster = {cl: speed(mode, cl) for cl in (False, True)}
            if None in faster.values():
                continue
            default = data["defaults"].get(mode)
            checks.append((mode, default, faster[default] >= max(faster.values()) / 1.02))
        out.append(
            (
                "each mode's default layout is its faster one (within 2%)",
                ", ".join(
                    f"{m}: {'channels_last' if d else 'NCHW'} {'ok' if ok else 'slower'}"
                    for m, d, ok in checks
                )
                or "-",
                _holds(all(ok for *_, ok in checks) if checks else None),
            )
        )
    ckpt = [r for r in data.get("checkpointing", []) if "skipped" not in r]
    none = next((r for r in ckpt if r["setting"] == "none"), None)
    if none and len(ckpt) > 1:
        others = [
            r | {"mem": r["peak_mb"] / none["peak_mb"], "time": r["step_ms"] / none["step_ms"]}
            for r in ckpt
            if r is not none
        ]
        fast = [r for r in others if r["time"] <= CKPT_TIME] or others
        best = min(fast, key=lambda r: r["mem"])
        out.append(
            (
                f"activation checkpointing, best setting: peak memory <= {CKPT_MEMORY} x none's "
                f"at <= {CKPT_TIME} x its step time",
                f"{best['setting']}: {_fmt(best['peak_mb'])} vs {_fmt(none['peak_mb'])} MB "
                f"({best['mem']:.2f}), {best['step_ms']:.1f} vs {none['step_ms']:.1f} ms "
                f"({best['time']:.2f})",
                _holds(best["mem"] <= CKPT_MEMORY and best["time"] <= CKPT_TIME),
            )
        )
    auto = data.get("auto")
    if auto:
        cl = auto["channels_last"]
        table = {m: speed(m, cl) for m in auto["candidates"] if speed(m, cl)}
        finite = [m for m in table if auto["finite"].get(m)]
        fastest = max(finite, key=table.get) if finite else None
        agrees = table.get(auto["chosen"], 0) >= 0.95 * table[fastest] if fastest else None
        probed = ", ".join(f"{m} {_fmt(v)}" for m, v in auto["images_per_sec"].items())
        out.append(
            (
                "precision=auto: probe <= its budget, and picks a mode within 5% of the "
                "fastest finite one of the table above",
                f"{auto['chosen']} in {auto['seconds']:.1f} s (probe img/s: {probed}; "
                f"table's fastest: {fastest})",
                _holds(
                    None if agrees is None else agrees and auto["seconds"] <= auto["budget"] + 2
                ),
            )
        )
    for case in data.get("framework", []):
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
    host = data.get("host")
    if host:
        ms = host["ms_per_step"]
        out.append(
            (
                f"host work of a recipe step (Lightning, module, every callback) <= "
                f"{HOST_STEP_MS} ms (airbench94's H100 step at batch 1024)",
                f"{ms['lightning']:.2f} ms (plain loop {ms['plain']:.2f} ms; tiny net)",
                _holds(ms["lightning"] <= HOST_STEP_MS),
            )
        )
        out.append(
            (
                f"Lightning's extra host work per step <= {HOST_EXTRA_MS} ms",
                f"{host['lightning_extra_ms_per_step']:.2f} ms",
                _holds(host["lightning_extra_ms_per_step"] <= HOST_EXTRA_MS),
            )
        )
    run = data.get("speedrun")
    if run:
        if "failed" in run:
            out.append(("experiment=speedrun_gpu runs", f"failed: {run['failed']}", "no"))
        else:
            train, fit = run["train_seconds"], run["fit_seconds"]
            compiled = run.get("compile_seconds") or 0.0
            per_epoch = train / run["epochs"] if train and run["epochs"] else None
            images = data["sizes"]["images"]
            out.append(
                (
                    f"experiment=speedrun_gpu: an epoch of {images:,} images <= {EPOCH_S} s",
                    f"{_fmt(per_epoch, ' s', 3)} (train_seconds {_fmt(train, '', 2)} / "
                    f"{run['epochs']} epochs)",
                    _holds(per_epoch <= EPOCH_S if per_epoch else None),
                )
            )
            out.append(
                (
                    f"speedrun_gpu: fit_seconds (compile included) <= {FIT_OVER_TRAIN} x "
                    "train_seconds",
                    f"fit {_fmt(fit, ' s', 2)}, train {_fmt(train, ' s', 2)}, compile "
                    f"{_fmt(run.get('compile_seconds'), ' s', 2)}",
                    _holds(fit <= FIT_OVER_TRAIN * train if fit and train else None),
                )
            )
            rest = fit - train - compiled if fit and train else None
            out.append(
                (
                    f"speedrun_gpu: fit - train - compile <= {OUTSIDE_TRAIN:.0%} of train_seconds",
                    f"{_fmt(rest, ' s', 2)} ({rest / train:.0%})" if rest is not None else "-",
                    _holds(rest <= OUTSIDE_TRAIN * train if rest is not None else None),
                )
            )
    for name, label in (("gpu", "`pytest -m gpu`"), ("default", "the default test suite")):
        t = data.get("tests", {}).get(name)
        if t:
            out.append((f"{label} passes on this machine", t["summary"], _holds(t.get("passed"))))
    return out


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
        + ", ".join(f"{k} {v:.0f} s" for k, v in data["section_seconds"].items())
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
            "Precision modes (median step after warm-up; peak memory over the timed steps):\n\n"
        )
        table = []
        for r in prec:
            lt, pl = r["lightning"], r["plain"]
            table.append(
                [
                    r["mode"],
                    "channels_last" if r["channels_last"] else "NCHW",
                    lt.get("images_per_sec"),
                    pl.get("images_per_sec"),
                    lt.get("step_ms"),
                    pl.get("step_ms"),
                    lt.get("peak_mb"),
                    pl.get("peak_mb"),
                ]
            )
        cols = ["mode", "layout", "template img/s", "plain img/s", "template ms", "plain ms"]
        text.append(report.markdown([*cols, "template MB", "plain MB"], table))
    ckpt = data.get("checkpointing", [])
    if ckpt:
        text.append("\nActivation checkpointing (16-mixed, template):\n\n")
        table = [[r["setting"], r.get("step_ms"), r.get("peak_mb"), r.get("skipped")] for r in ckpt]
        text.append(report.markdown(["setting", "step ms", "peak MB", "note"], table))
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
    import torch

    from bench import synthetic

    start = time.perf_counter()
    deadline = start + args.budget
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
        "defaults": {},
    }
    from cifar_amp.precision import Precision

    for mode in ("32-true", "16-mixed", "bf16-mixed"):
        data["defaults"][mode] = Precision(mode).channels_last(device)
    dms: dict = {}  # DataModules by layout, loaded once for the steps sections
    sections = {
        "precision": lambda: precision_section(sizes, data_dir, work, device, dms),
        "checkpointing": lambda: checkpointing_section(sizes, data_dir, work, device, dms),
        "auto": lambda: auto_section(sizes, data_dir, work, device, dms),
        "framework": lambda: framework_section(sizes, data_dir, work, device),
        "host": lambda: host_section(sizes, args.data_dir, work, device),
        "speedrun": lambda: speedrun_section(sizes, data_dir, work, deadline),
        "tests": lambda: tests_section(args.tests, deadline),
    }
    data["section_seconds"] = {}
    threads = torch.get_num_threads()
    if not cuda:  # tiny networks: a second thread's waits on a busy CPU cost more than it adds
        torch.set_num_threads(1)
    try:
        for name, section in sections.items():
            if name not in args.sections:
                continue
            if name == "framework":  # the steps sections' data is no longer needed
                dms.clear()
            _release()
            began = time.perf_counter()
            data[name] = section()
            data["section_seconds"][name] = round(time.perf_counter() - began, 1)
    finally:
        torch.set_num_threads(threads)
    data["seconds"] = time.perf_counter() - start
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
        "--budget", type=float, default=600, help="seconds; the test suites get the rest"
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
    data = run(args, out)
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
