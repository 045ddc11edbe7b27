"""`make bench-gpu` (`python -m bench.gpu`): every GPU promise of the template, measured in one
command, as one table: target | measured | holds.

    python -m bench.gpu [--data-dir <CIFAR-10 folder>] [--tests all|gpu|none] [--budget 600]
                        [--airbench <airbench94.py>]

On a CUDA machine (within `--budget`, 600 s: meant for one H100) it measures:
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
and writes it (bench/gpu_table.py), with the raw JSON and a chart, into the record section
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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import budget
from bench import gpu_table as table

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks-gpu.md"
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
# Each section's share of what the sections before it left of --budget (600 s: about 120 s for
# precision, 105 for framework, 100 for speedrun, 160 for the tests; the quick ones leave theirs
# to the next).
SHARES = {
    "precision": 3.0,
    "checkpointing": 1.0,
    "auto": 1.0,
    "framework": 2.5,
    "host": 1.0,
    "speedrun": 2.5,
    "tests": 3.5,
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
            # the default layouts' cases first: the ones a cut would cost most
            modes=[
                *("16-mixed cl", "bf16-mixed cl", "32-true cl", "32-true nchw"),
                *("16-mixed nchw", "bf16-mixed nchw", "32-true-strict nchw", "32-true-strict cl"),
            ],
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


def _measured(window, batch: int, device) -> dict:
    """The timed steps' mean time and memory, from `window` (bench/memory.py's StepWindow);
    off CUDA, the process's peak RSS instead."""
    from cifar_amp.extras.diagnostics.diagnostics import peak_rss_mb

    if (step := window and window.step_seconds) is None:  # fit stopped early
        return {"skipped": "the run stopped before its timed steps ended"}
    cuda = device.type == "cuda"
    return {
        "step_ms": 1e3 * step,
        "images_per_sec": batch / step,
        "peak_mb": window.peak_mb if cuda else peak_rss_mb(),
        "step_peak_mb": window.step_peak_mb,
        "base_mb": window.base_mb,
    }


def lightning_steps(cfg, sizes: Sizes, datamodules: dict) -> dict:
    """The template's steps: their time (one window) and memory."""
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
    measured = _measured(meter.memory, cfg.data.batch_size, device)
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
    dm = datamodule(cfg, prec.channels_last, trainer, datamodules)
    module = build.module(cfg, dm.num_classes, prec.channels_last)
    net = module.net.to(device)
    optimizer = instantiate(module.hparams.optimizer, params=net.parameters())
    steps = sizes.warmup + sizes.timed
    scheduler = module.hparams.scheduler and instantiate(
        module.hparams.scheduler, optimizer=optimizer, total_steps=steps
    )
    clip = cfg.trainer.get("gradient_clip_val")  # the default trainer clips, as Lightning does
    step = Step(net, optimizer, scheduler, prec.name, module.hparams.label_smoothing, clip=clip)
    loader, batches = dm.train_dataloader(), iter(())
    window = StepWindow(device, sizes.warmup, sizes.timed)
    net.train()
    try:
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            window.start()
            step(*batch)
            window.stop()
    except torch.OutOfMemoryError:
        return {"skipped": "out of memory"}
    return _measured(window, cfg.data.batch_size, device)


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
    """precision=auto's probe on the precision section's network, batch, optimizer and clipping:
    the table's row checks its choice against the template's own steps in the precision rows."""
    from cifar_amp import build
    from cifar_amp.extras.auto_precision import autoprecision as A
    from cifar_amp.precision import native

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
    dm = datamodule(cfg, prec.channels_last, trainer, {})
    module = build.module(cfg, dm.num_classes, prec.channels_last)
    names = A.candidates(dev.type, *native(dev.type))
    batch = next(iter(dm.train_dataloader()))  # as the probe takes it in a run
    start = time.perf_counter()
    clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)  # the run's, as a run's
    found = A.probe(
        module, batch, names, lambda n: prec.plugin(dev.type, n), dev, prec.probe_seconds, clip
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
        "channels_last": prec.channels_last,
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
        timeout = max(1.0, ctx.left() - (30 if ctx.airbench else 2))  # airbench94: about 20 s
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
    if not ctx.airbench:
        result["airbench94"] = {"skipped": "no --airbench"}
    elif ctx.device != "cuda":
        result["airbench94"] = {"skipped": "airbench94 needs CUDA"}
    else:
        from bench import airbench

        _log(f"airbench94: {ctx.airbench}")
        result["airbench94"] = airbench.run(ctx.airbench, ctx.data_dir, ctx.work, ctx.deadline)
    return result


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
        data["defaults"][mode] = Precision(mode).channels_last_on(device)

    def save(data: dict) -> None:
        data["seconds"] = time.perf_counter() - start
        (out / "bench_gpu.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (out / "bench_gpu.md").write_text(table.markdown(data))

    jobs = []
    for name in (s for s in SECTIONS if s in args.sections):
        ctx = Context(sizes, data_dir, args.data_dir, work, device, 0.0, args.tests, args.airbench)
        if name == "tests" and args.tests == "none":  # nothing to run: no share of the budget
            data["tests"] = tests_section(ctx, lambda _: None)
            continue
        jobs.append((name, SHARES[name], RUNS[name], ctx))
    left = args.budget - RESERVE_S - (time.perf_counter() - start)
    (out / "sections").mkdir(exist_ok=True)
    budget.run_sections(jobs, left, data, save, out / "sections", "spawn" if cuda else "forkserver")
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
    data["chart_note"] = table.chart(data, picture)
    data["chart"] = None if data["chart_note"] else picture.name
    text = table.markdown(data)
    (out / "bench_gpu.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out / "bench_gpu.md").write_text(text)
    if doc is not None:
        table.write_record(doc, text)
    print()
    from bench import report

    print(report.markdown(["target", "measured", "holds"], table.rows(data)))
    where = f"{out}/bench_gpu.{{md,json}}" + (f" and the record section of {doc}" if doc else "")
    print(f"wrote {where}")
    return data


if __name__ == "__main__":
    main()
