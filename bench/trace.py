"""Where a training step's time goes, by torch.profiler: ordinary steps of the default recipe
(train.py's config, through Lightning, every default callback, the logger and progress bar a
user gets) and of the plain loop (bench/reference_loop.Step: same network, initial weights,
optimizer, schedule, clipping, precision and device-resident batches), side by side.

    python -m bench.trace                                  # CPU: SpeedNet 4,4,4, batch 8
    python -m bench.trace --device cuda --data-dir data/cifar10-subset \
        --precision 32-true,bf16-mixed,16-mixed --out logs/trace

Each loop, after `--warmup` steps, runs two windows of `--steps` whole steps (each from one
step's `on_train_batch_start` to the next's, the device waited for at the window's ends only):
- the timed window, profiling torch ops and, on CUDA, the GPU's kernels and copies: the step's
  wall milliseconds; the host's milliseconds a step (the window less the time the host thread
  waited in the CUDA runtime's synchronising calls); the GPU's busy fraction (the union of its
  kernels' and copies' intervals over the window); its Chrome trace (`trace_<loop>_<mode>.json.gz`,
  for Perfetto or chrome://tracing);
- the attribution window, with Python's stacks too (which slow the host several-fold, so its
  times are read as a split, not as sizes): each event's own host time goes to the nearest
  Python frame with an owner, as in bench/host_work.py (Lightning, torchmetrics, each cifar_amp
  module, the plain loop itself, torch's network, optimizer and autocast code), and each such
  function's total: the largest owners and functions, milliseconds a step.
Without CUDA the GPU's fields are n/a. The summary (`trace.json`, `trace.md` in `--out`) is
rewritten after each loop, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench import gpu, host_work, report, synthetic
from bench.reference_loop import Step, sync
from cifar_amp import build, training

# CUDA runtime calls in which the host waits for the device
WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
NO_PYTHON = "no Python caller (autograd's backward thread, ...)"
# A thread blocked in these (the progress bar's renderer between refreshes) is idle, not busy
IDLE = ("acquire of _thread.", "built-in function sleep", "method select of", "method poll of")


class Windows:
    """Opens and closes the two profiled windows at whole-step boundaries: call `at(step)` at
    the start of each step (and once after the last); `report` reads what they saw."""

    def __init__(self, device: torch.device, warmup: int, steps: int, traces: Path | None):
        self.device, self.warmup, self.steps, self.traces = device, warmup, steps, traces
        self.profiler: profile | None = None
        self.seconds: list[float] = []
        self.profiles: list[profile] = []
        self._t0 = 0.0

    @property
    def last(self) -> int:  # the step at whose start the second window closes
        return self.warmup + 2 * self.steps

    def at(self, step: int) -> None:
        if step in (self.warmup + self.steps, self.last) and self.profiler is not None:
            sync(self.device)
            self.seconds.append(time.perf_counter() - self._t0)
            self.profiler.stop()
            self.profiles.append(self.profiler)
            self.profiler = None
        if step in (self.warmup, self.warmup + self.steps):
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            stacks = step != self.warmup  # the second window attributes host time to Python
            self.profiler = profile(activities=activities, with_stack=stacks)
            sync(self.device)
            self.profiler.start()
            self._t0 = time.perf_counter()

    def report(self, top: int) -> dict:
        timed, attributed = self.profiles
        n, seconds = self.steps, self.seconds[0]
        events = timed.events()
        waits = [e for e in events if e.name in WAITS]
        waited = sum(e.time_range.elapsed_us() for e in waits) / 1e6
        gpu = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = None
        if gpu and any(e.time_range.elapsed_us() > 0 for e in gpu):
            busy = _union([e.time_range for e in gpu])
        # Where the profiler got no times from the GPU (CUPTI gave a lent H200 none: every
        # kernel and runtime call at 0 us), the waits and the GPU's busy time are unknown.
        untimed = bool(gpu) and busy is None
        owners, functions = attribute(attributed.events())
        per_step = 1 / (1e3 * n)  # microseconds in the window -> milliseconds a step
        return {
            "steps": n,
            "step_ms": round(1e3 * seconds / n, 3),
            "host_ms_per_step": None if untimed else round(1e3 * (seconds - waited) / n, 3),
            "host_wait_ms_per_step": None if untimed else round(1e3 * waited / n, 3),
            "gpu_untimed_events": sum(1 for e in gpu if e.time_range.elapsed_us() <= 0),
            "gpu_busy_ms_per_step": None if busy is None else round(busy / 1e3 / n, 3),
            "gpu_busy_fraction": None if busy is None else round(busy / 1e6 / seconds, 3),
            "attributed_step_ms": round(1e3 * self.seconds[1] / n, 3),
            "owners_ms_per_step": _top(owners, per_step, top),
            "functions_ms_per_step": _top(functions, per_step, top),
        }

    def save_trace(self, name: str) -> str | None:
        if self.traces is None:
            return None
        self.traces.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            self.profiles[0].export_chrome_trace(str(raw))
            path = self.traces / f"trace_{name}.json.gz"
            with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
        return path.name


def counts(path: Path, steps: int, top: int = 3) -> dict:
    """Per step, from a Chrome trace of `steps` steps (counts do not drift as times do): torch
    ops, CUDA runtime calls, kernels, copies; the milliseconds the main thread spent inside
    torch's top-level ops (the rest of its step is Python between them: the loop, hooks,
    callbacks); and its `top` longest single ops (a one-time cost, such as a kernel's first
    load, shows there)."""
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]

    def per_step(cat: str) -> float:
        return round(sum(1 for e in events if e.get("cat") == cat) / steps, 1)

    ops = [e for e in events if e.get("cat") == "cpu_op"]
    stepping = [e for e in events if e["name"].startswith("Optimizer.step")]
    busiest = Counter(e["tid"] for e in ops).most_common(1)
    main = stepping[0]["tid"] if stepping else busiest[0][0] if busiest else None
    outer, end = [], float("-inf")
    for e in sorted((e for e in ops if e["tid"] == main), key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:  # not inside the op before it
            outer.append(e)
            end = e["ts"] + e["dur"]
    longest = sorted(outer, key=lambda e: -e["dur"])[:top]
    return {
        "ops_per_step": per_step("cpu_op"),
        "runtime_calls_per_step": per_step("cuda_runtime"),
        "kernels_per_step": per_step("kernel"),
        "copies_per_step": per_step("gpu_memcpy"),
        "main_thread_ops_ms_per_step": round(sum(e["dur"] for e in outer) / 1e3 / steps, 3),
        "longest_ops_ms": {
            f"{e['name']} #{i}": round(e["dur"] / 1e3, 2) for i, e in enumerate(longest)
        },
    }


def _union(ranges) -> float:
    """Microseconds covered by the intervals (start, end) of `ranges`."""
    total, end = 0.0, float("-inf")
    for r in sorted(ranges, key=lambda r: r.start):
        if r.end > end:
            total += r.end - max(r.start, end)
            end = r.end
    return total


def _top(values: dict, scale: float, top: int) -> dict:
    ranked = sorted(values.items(), key=lambda kv: -kv[1])[:top]
    return {k: round(v * scale, 3) for k, v in ranked}


def _frame(name: str) -> tuple[str, int, str] | None:
    """(path, line, function) of a profiler's Python event ("torch/nn/modules/conv.py(548):
    forward"); None for an op, a runtime call or a built-in."""
    path, sep, rest = name.partition("(")
    if not sep or not path.endswith(".py") or "): " not in rest:
        return None
    line, _, func = rest.partition("): ")
    return "/" + path.lstrip("/"), int(line) if line.isdigit() else 0, func


def attribute(events) -> tuple[dict, dict]:
    """Each CPU event's own time (us), given to the nearest Python frame on its stack that
    bench/host_work.py gives an owner: ({owner: us}, {"owner: file:line(function)": us}).
    A thread's waits (IDLE) are not host work."""
    owners: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    for e in events:
        if e.device_type != DeviceType.CPU or any(i in e.name for i in IDLE):
            continue
        own, node = e.self_cpu_time_total, e
        while node is not None:
            frame = _frame(node.name)
            name = frame and host_work.owner(frame)
            if name:
                owners[name] += own
                functions[f"{name}: {Path(frame[0]).name}:{frame[1]}({frame[2]})"] += own
                break
            node = node.cpu_parent
        else:
            owners[NO_PYTHON] += own
    return owners, functions


class LightningWindows(L.Callback):
    def __init__(self, windows: Windows) -> None:
        self.windows = windows

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.windows.at(trainer.global_step)


def config(args, mode: str, data_dir: Path, run_dir: Path):
    """train.py's default config for this mode and device, as many batches as the windows need."""
    overrides = [
        f"precision={mode}",
        f"data.data_dir={data_dir}",
        "data.download=false",
        f"trainer.max_steps={args.warmup + 2 * args.steps + 1}",
        "trainer.max_epochs=-1",
        "test=false",
        f"run_dir={run_dir}",
        *(["trainer=cpu"] if args.device == "cpu" else ["trainer.accelerator=gpu"]),
        *(["trainer.devices=1"] if args.device == "cuda" else []),
        *([f"data.batch_size={args.batch_size}"] if args.batch_size else []),
        *([f"model.widths=[{args.widths}]"] if args.widths else []),
        *args.overrides,
    ]
    return gpu.compose(overrides)


def lightning_loop(cfg, args, traces: Path | None, name: str) -> dict:
    run = training.build_run(cfg)
    windows = Windows(run.trainer.strategy.root_device, args.warmup, args.steps, traces)
    run.trainer.callbacks.append(LightningWindows(windows))
    with training.holding_run_dir(run):
        training.record_config(run)
        training.fit(run)
    callbacks = [type(c).__name__ for c in run.trainer.callbacks][:-1]
    return windows.report(args.top) | traced(windows, name) | {"callbacks": callbacks}


def plain_loop(cfg, args, traces: Path | None, name: str) -> dict:
    """The same set-up in bench/reference_loop.Step (as bench.gpu's plain rows build it)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    prec = build.precision(cfg)
    trainer = build.trainer(cfg, prec)  # TF32 and the layout for its device
    device = trainer.strategy.root_device
    dm = gpu.datamodule(cfg, prec.channels_last, trainer, {})
    module = build.module(cfg, dm.num_classes, prec.channels_last)
    net = module.net.to(device)
    optimizer = instantiate(module.hparams.optimizer, params=net.parameters())
    windows = Windows(device, args.warmup, args.steps, traces)
    scheduler = module.hparams.scheduler and instantiate(
        module.hparams.scheduler, optimizer=optimizer, total_steps=windows.last + 1
    )
    clip = cfg.trainer.get("gradient_clip_val")
    step = Step(net, optimizer, scheduler, prec.name, module.hparams.label_smoothing, clip=clip)
    loader, batches = dm.train_dataloader(), iter(())
    net.train()
    for i in range(windows.last + 1):
        batch = next(batches, None)
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        windows.at(i)
        if i < windows.last:
            step(*batch)
    return windows.report(args.top) | traced(windows, name)


def traced(windows: Windows, name: str) -> dict:
    """The timed window's Chrome trace, saved, and its counts."""
    saved = windows.save_trace(name)
    return {"trace": saved} | (counts(windows.traces / saved, windows.steps) if saved else {})


COUNTED = (
    "ops_per_step",
    "runtime_calls_per_step",
    "kernels_per_step",
    "copies_per_step",
    "main_thread_ops_ms_per_step",
)


def summary_rows(cases: list[dict]) -> list[list]:
    """One row a case: the step, what it launched, and the main thread's time in and between
    torch's ops."""
    rows = []
    for c in cases:
        if "failed" in c:
            rows.append([c["loop"], c["precision"], "failed", *[""] * 7])
            continue
        inside = c.get("main_thread_ops_ms_per_step")
        between = None if inside is None else round(c["step_ms"] - inside, 2)
        busy = c["gpu_busy_fraction"]
        rows.append(
            [c["loop"], c["precision"], c["step_ms"], *[c.get(k, "-") for k in COUNTED], between]
            + ["n/a" if busy is None else busy]
        )
    return rows


def markdown(data: dict) -> str:
    lines = [f"# Where a step's time goes ({data['device']}, {data['net']})\n"]
    head = ["loop", "mode", "step ms", "torch ops", "CUDA runtime calls", "kernels", "copies"]
    head += ["ms in torch ops (main thread)", "ms between them", "GPU busy fraction"]
    lines.append("Per step, the timed window (counts from its Chrome trace):\n")
    lines.append(report.markdown(head, summary_rows(data["cases"])))
    for case in data["cases"]:
        lines.append(f"## {case['loop']}, {case['precision']}\n")
        if "failed" in case:
            lines.append(f"failed: {case['failed']}\n")
            continue
        if case.get("gpu_untimed_events"):
            lines.append(
                f"The profiler recorded {case['gpu_untimed_events']} GPU events without a time "
                "(no CUPTI timestamps on this machine): the host's waits and the GPU's busy time "
                "are unknown, n/a below.\n"
            )
        keys = ("step_ms", "host_ms_per_step", "host_wait_ms_per_step", "gpu_busy_ms_per_step")
        rows = [(k, case[k]) for k in (*keys, "gpu_busy_fraction", "attributed_step_ms")]
        lines.append(
            report.markdown(["", "value"], [(k, "n/a" if v is None else v) for k, v in rows])
        )
        lines.append(
            report.markdown(
                ["longest single ops", "ms"], list(case.get("longest_ops_ms", {}).items())
            )
        )
        if list(case["owners_ms_per_step"]) == [NO_PYTHON]:
            lines.append("The attribution window recorded no Python frames: no owners.\n")
            continue
        for what in ("owners_ms_per_step", "functions_ms_per_step"):
            lines.append(report.markdown([what, "ms"], list(case[what].items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m bench.trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--precision", default="32-true", help="modes, comma-separated")
    ap.add_argument("--data-dir", help="a CIFAR-10 folder whose images are repeated")
    ap.add_argument("--n-images", type=int, help="training images (default: what the steps need)")
    ap.add_argument("--batch-size", type=int, help="default: the config's (CPU: 8)")
    ap.add_argument(
        "--widths", help="SpeedNet widths, comma-separated (default: the config's; CPU: 4,4,4)"
    )
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=20, help="steps in each window")
    ap.add_argument("--top", type=int, default=12, help="owners and functions listed")
    ap.add_argument("--out", type=Path, help="default: logs/trace/<time>")
    ap.add_argument(
        "--counts",
        type=Path,
        help="only read a folder this command wrote (trace.json and its Chrome traces) again: "
        "its counts recomputed, trace.md rewritten and printed",
    )
    ap.add_argument("overrides", nargs="*", help="more train.py overrides (model=resnet18, ...)")
    args = ap.parse_args(argv)
    if args.counts:
        return recount(args.counts)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA here")
    if args.device == "cpu":  # a CPU step of the GPU-sized default would take seconds
        args.batch_size, args.widths = args.batch_size or 8, args.widths or "4,4,4"
    out = args.out or gpu.REPO / "logs" / "trace" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    data = {"device": args.device, "argv": argv if argv is not None else sys.argv[1:], "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cfg = config(args, "32-true", work / "data", work / "run")
        steps = args.warmup + 2 * args.steps + 2
        n = args.n_images or max(steps * cfg.data.batch_size * 10 // 9 + 64, 1024)
        data_dir, data["images"] = synthetic.write(work / "data", n, 64, args.data_dir)
        data["net"] = cfg.model._target_.rsplit(".", 1)[1] + (
            f" {args.widths}" if args.widths else ""
        )
        data["batch_size"] = cfg.data.batch_size
        for mode in args.precision.split(","):
            for loop, fn in (("lightning", lightning_loop), ("plain", plain_loop)):
                name = f"{loop}_{mode}"
                print(f"[trace] {name}", file=sys.stderr, flush=True)
                case = {"loop": loop, "precision": mode}
                try:
                    cfg = config(args, mode, data_dir, work / name)
                    case |= fn(cfg, args, out, name)
                except Exception as e:  # the other cases still run; the summary says why
                    case["failed"] = f"{type(e).__name__}: {e}"
                data["cases"].append(case)
                (out / "trace.json").write_text(json.dumps(data, indent=2) + "\n")
                (out / "trace.md").write_text(markdown(data))
                with contextlib.suppress(Exception):
                    torch.cuda.empty_cache()
    print(markdown(data))
    print(f"wrote {out}/trace.{{json,md}} and the Chrome traces")
    return data


def recount(folder: Path) -> dict:
    """trace.json of `folder` with each case's counts read again from its Chrome trace."""
    data = json.loads((folder / "trace.json").read_text())
    for case in data["cases"]:
        if case.get("trace"):
            case |= counts(folder / case["trace"], case["steps"])
    (folder / "trace.json").write_text(json.dumps(data, indent=2) + "\n")
    (folder / "trace.md").write_text(markdown(data))
    print(markdown(data))
    return data


if __name__ == "__main__":
    main()
