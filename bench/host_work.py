"""Where the host time of a training step goes: one epoch of the plain loop and one of the
recipe's Lightning run (bench/framework.py, same flags), each under cProfile, time per step
by the package that spent it.

    python -m bench.host_work                      # SpeedNet 4,4,4, batch 8: host work only
    python -m bench.host_work --device cuda --widths 64,256,256 --batch-size 1024 \
        --precision bf16-mixed --fused --n-images 50000

Each function's own time goes to its package: Lightning, torchmetrics, each cifar_amp module,
bench (the plain loop itself), torch (the network's forward and backward, the optimizer,
autocast: the same work in both loops). Time in built-in functions (torch ops, getattr, ...),
in the standard library (contextlib, ...) and in torch's other Python (nn.Module.__setattr__,
grad-mode contexts, get_total_norm, ...) goes to the package that called them, so
Lightning's profiler contexts and its `nn.Module.__setattr__` calls count as Lightning's. cProfile adds a fixed cost to every
Python call, which inflates Python-heavy parts (Lightning's loop) more than torch ops: the
split is what to read, and bench.framework's unprofiled milliseconds per step are the sizes.
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import pstats
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch

from bench import framework, synthetic
from cifar_amp import training

PACKAGES = (  # (path fragment, owner), first match wins
    ("/lightning_utilities/", "Lightning"),
    ("/lightning/", "Lightning"),
    ("/lightning_fabric/", "Lightning"),
    ("/pytorch_lightning/", "Lightning"),
    ("/torchmetrics/", "torchmetrics"),
    ("/bench/", "bench (the plain loop)"),
)
TORCH = "torch (network forward and backward, optimizer, autocast)"
# torch's Python that does the step's work, the same in both loops. The rest of torch's Python
# (nn.Module.__setattr__, grad-mode contexts, get_total_norm, ...) is a tool its caller uses.
NETWORK = (
    "/torch/nn/modules/",
    "/torch/nn/functional.py",
    "/torch/autograd/__init__.py",
    "/torch/optim/",
    "/torch/amp/",
)
TOOLS = ("__setattr__", "__getattr__", "__delattr__")


def owner(func: tuple) -> str | None:
    """The package a function (cProfile's (file, line, name)) belongs to; None for built-ins,
    the standard library and torch's tools, whose time goes to their callers."""
    path, _, name = func
    path = path.replace("\\", "/")
    if "/cifar_amp/" in path:
        module = path.rsplit("/cifar_amp/", 1)[1].removesuffix(".py").replace("/", ".")
        return f"cifar_amp.{module}"
    if "/torch/" in path:
        network = any(f in path for f in NETWORK) and name not in TOOLS
        return (
            TORCH if network or path.endswith("/torch/_tensor.py") and name == "backward" else None
        )
    return next((owner for frag, owner in PACKAGES if frag in path), None)


def by_owner(stats: pstats.Stats, steps: int, top: int = 0) -> dict:
    """Microseconds per step by owner (see the module doc); with `top`, also each owner's
    `top` functions that spent most (their own time and that of what they called outside
    their package)."""
    raw = stats.stats  # func -> (cc, nc, own time, cumulative, {caller: (cc, nc, tt, ct)})
    out: dict[str, float] = defaultdict(float)
    funcs: dict[tuple, float] = defaultdict(float)

    def give(func, seconds: float, depth: int = 0) -> None:
        name = owner(func)
        if name is not None:
            out[name] += seconds
            funcs[(name, f"{Path(func[0]).name}:{func[1]}({func[2]})")] += seconds
            return
        callers = raw.get(func, (0, 0, 0, 0, {}))[4]
        total = sum(c[2] for c in callers.values())
        if depth > 20 or not callers or total <= 0:
            out["Python (unattributed)"] += seconds
            return
        for caller, c in callers.items():
            give(caller, seconds * c[2] / total, depth + 1)

    for func, (_, _, own, _, _) in raw.items():
        give(func, own)
    us = {k: round(1e6 * v / steps, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}
    if not top:
        return us
    tops: dict[str, dict[str, float]] = defaultdict(dict)
    for (name, label), v in sorted(funcs.items(), key=lambda kv: -kv[1]):
        if len(tops[name]) < top:
            tops[name][label] = round(1e6 * v / steps, 1)
    return {"total": us, "top": dict(tops)}


class Profiled(L.Callback):
    """cProfile on from an epoch's start to the end of its last batch."""

    def __init__(self, timer=time.perf_counter) -> None:
        self.profile = cProfile.Profile(timer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.profile.enable()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch_idx + 1 == trainer.num_training_batches:
            self.profile.disable()


def profile(args, work: Path, top: int = 0) -> dict:
    data_dir, _ = synthetic.write(work / "data", args.n_images, 16, args.data_dir, args.seed)
    cfg = framework.recipe_cfg(args, data_dir, work / "run")
    initial = training.build_run(cfg).module
    freeze = framework.frozen(cfg)
    timer = time.process_time if args.cpu_time else time.perf_counter
    loader, out = None, {}
    rounds = [False] * args.warmup_rounds + [True]  # warm-up rounds, then the profiled one
    for i, profiled in enumerate(rounds):
        cfg.run_dir = str(work / f"run{i}")
        run = training.build_run(cfg)
        probe = Profiled(timer)
        if profiled:
            run.trainer.callbacks.append(probe)
        with training.holding_run_dir(run):
            training.record_config(run)
            training.fit(run)
        steps = args.epochs * run.trainer.num_training_batches
        loader = loader or run.datamodule.train_dataloader()
        plain = cProfile.Profile(timer)
        around = plain if profiled else contextlib.nullcontext()
        framework.run_plain(initial, loader, args.epochs, args.precision, freeze, around)
        if profiled:
            out = {
                "plain": by_owner(pstats.Stats(plain), steps),
                "lightning": by_owner(pstats.Stats(probe.profile), steps, top=top),
            }
    lightning = out["lightning"]["total"] if top else out["lightning"]
    totals = {"plain": sum(out["plain"].values()), "lightning": sum(lightning.values())}
    return {
        "us_per_step_by_owner": out,
        "us_per_step": {k: round(v, 1) for k, v in totals.items()},
        "lightning_extra_us_per_step": round(totals["lightning"] - totals["plain"], 1),
        "callbacks": [type(c).__name__ for c in run.trainer.callbacks if c is not probe],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = framework.parser()
    ap.prog = "python -m bench.host_work"
    ap.description = __doc__
    ap.set_defaults(widths="4,4,4", batch_size=8, n_images=1024, epochs=1)
    ap.add_argument("--top", type=int, default=0, help="also each owner's N costliest functions")
    args = ap.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",")]
    if args.cpu_time:
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    with tempfile.TemporaryDirectory() as tmp:
        report = profile(args, Path(tmp), args.top)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
