"""`python -m cifar_amp.bench.precision [overrides]`: every precision mode, with and without
activation checkpointing, trained through train.py's own path (`cifar_amp.train.train`).

Per case: median training-step time after warm-up, images/s, peak memory, test accuracy
after the short training, GradScaler skipped steps; on GPU also the largest batch size that
fits (Lightning's batch-size finder). Writes bench_precision.{md,json,png} to its run dir.
"""

from __future__ import annotations

import copy
import json
import logging
import multiprocessing
import statistics
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from lightning import Callback
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from cifar_amp import config, metrics, precision
from cifar_amp.bench import report
from cifar_amp.callbacks.precision_diagnostics import _peak_rss_mb
from cifar_amp.config import PRECISIONS, TrainConfig, _check
from cifar_amp.errors import reported
from cifar_amp.train import build_datamodule, build_module, build_trainer, train

log = logging.getLogger(__name__)
STEP_TIMES = "step_times.json"


@dataclass
class BenchConfig(TrainConfig):
    modes: list = field(
        default_factory=lambda: ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
    )
    checkpointing: list = field(
        default_factory=lambda: [0, 1]
    )  # model.activation_checkpointing values
    warmup_steps: int = 5  # first training steps of each case left out of the step-time median
    # Modes also run (checkpointing off) without PrecisionDiagnostics, to show what it costs.
    overhead_modes: list = field(default_factory=lambda: ["32-true", "16-mixed"])
    # Each case in a fresh process: on CPU the peak RSS is per process and never resets.
    isolate: bool = True
    find_batch_size: bool = True  # GPU only: largest batch that fits, per mode
    batch_size_trials: int = 8  # doublings the finder may try from data.batch_size

    def validate(self) -> None:
        super().validate()
        for key in ("modes", "overhead_modes"):
            bad = [m for m in getattr(self, key) if m not in PRECISIONS]
            _check(not bad, key, f"{bad}; valid: {PRECISIONS}")
        _check(bool(self.modes), "modes", "at least one precision mode")
        _check(
            bool(self.checkpointing) and all(k >= 0 for k in self.checkpointing),
            "checkpointing",
            "values >= 0",
        )
        _check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        _check(self.batch_size_trials >= 1, "batch_size_trials", "must be >= 1")


ConfigStore.instance().store(name="bench_precision_schema", node=BenchConfig)
BENCH_KEYS = {f.name for f in fields(BenchConfig)} - {f.name for f in fields(TrainConfig)}


class StepTimer(Callback):
    """Wall time of every training step (forward, backward, optimizer step, callbacks).
    Benchmark only: it synchronises the device around each step, which timing one needs."""

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_start(self, trainer, pl_module) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.seconds.append(time.perf_counter() - self._t0)

    @rank_zero_only
    def on_train_end(self, trainer, pl_module) -> None:
        path = Path(trainer.default_root_dir) / STEP_TIMES
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.seconds))


def largest_batch(cfg: TrainConfig, trials: int) -> int:
    dm = build_datamodule(cfg)
    trainer = build_trainer(cfg, callbacks=[], loggers=[])
    return Tuner(trainer).scale_batch_size(
        build_module(cfg, dm.num_classes),
        datamodule=dm,
        mode="binsearch",
        init_val=cfg.data.batch_size,
        max_trials=trials,
    )


def cannot_run(cfg: TrainConfig) -> str | None:
    """Why this device cannot train the model in this precision (None if it can): one
    forward and backward of two images under the trainer's precision plugin."""
    plugin = build_trainer(cfg, callbacks=[], loggers=[]).precision_plugin
    device = precision.device_type(cfg.trainer)
    try:
        with plugin.module_init_context():
            net = instantiate(cfg.model, num_classes=10).to(device)
        x = plugin.convert_input(torch.randn(2, 3, 32, 32, device=device))
        with plugin.forward_context():
            out = net(x)
        out.float().sum().backward()
    except (
        RuntimeError,
        NotImplementedError,
        TypeError,
    ) as e:  # e.g. an op without a kernel for the dtype
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first}"[:160]
    return None


def run_case(case: dict, warmup: int, find_batch_size: int) -> dict:
    """Train one case (a plain, resolved TrainConfig dict), or say why the device cannot."""
    cfg = config.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), case))
    reason = cannot_run(cfg)
    if reason:
        log.warning("%s skipped: %s", cfg.precision.name, reason)
        return {"skipped": reason}
    cuda = precision.device_type(cfg.trainer) == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result = train(cfg)
    times = json.loads((Path(cfg.run_dir) / STEP_TIMES).read_text())
    timed = times[warmup:] or times
    out = {
        "step_ms": 1000 * statistics.median(timed),
        "timed_steps": len(timed),
        "images_per_sec": cfg.data.batch_size / statistics.median(timed),
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else _peak_rss_mb(),
        "test_acc": result.get(metrics.TEST_ACC),
        "skipped_steps": result.get(metrics.SKIPPED_STEPS),
    }
    if find_batch_size:
        out["max_batch_size"] = largest_batch(cfg, find_batch_size)
    return out


def _run(fn, *args, isolate: bool):
    if not isolate:
        return fn(*args)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def run(cfg: DictConfig) -> list[dict]:
    bench: BenchConfig = config.to_object(cfg)
    # Unresolved, so that `${run_dir}/...` paths follow each case's own run_dir.
    base = {
        k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k not in BENCH_KEYS
    }
    base["callbacks"]["step_timer"] = {"_target_": f"{__name__}.StepTimer"}
    out_dir = Path(bench.run_dir)
    cuda = precision.device_type(bench.trainer) == "cuda"
    finder = bench.batch_size_trials if bench.find_batch_size and cuda else 0
    plan = [(m, k, True) for m in bench.modes for k in bench.checkpointing]
    plan += [(m, 0, False) for m in bench.overhead_modes]
    rows = []
    for mode, every, diagnostics in plan:
        case = copy.deepcopy(base)
        case["precision"]["name"] = mode
        case["model"]["activation_checkpointing"] = every
        case["run_dir"] = str(out_dir / f"{mode}_ckpt{every}{'' if diagnostics else '_nodiag'}")
        if not diagnostics:
            case["callbacks"].pop("precision_diagnostics", None)
        log.info("Case %s, activation_checkpointing=%d, diagnostics=%s", mode, every, diagnostics)
        case = OmegaConf.to_container(OmegaConf.create(case), resolve=True)
        res = _run(
            run_case,
            case,
            bench.warmup_steps,
            finder if diagnostics and every == 0 else 0,
            isolate=bench.isolate,
        )
        rows.append({"mode": mode, "checkpointing": every, "diagnostics": diagnostics, **res})
    (out_dir / "bench_precision.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_report(
        rows,
        bench,
        cfg.model._target_.rsplit(".", 1)[-1],
        out_dir,
        "cuda" if cuda else "cpu",
        finder_note=None if cuda else "CPU: not run (no device memory limit to find)",
    )
    return rows


def _ratio(a, b):
    return a / b if a is not None and b else None


def write_report(
    rows: list[dict],
    bench: BenchConfig,
    model: str,
    out_dir: Path,
    device: str,
    finder_note: str | None,
) -> None:
    main = [r for r in rows if r["diagnostics"]]
    ref = {r["checkpointing"]: r for r in main if r["mode"] == "32-true" and "skipped" not in r}
    plain = {r["mode"]: r for r in main if r["checkpointing"] == 0}
    cols = [
        "mode",
        "act. ckpt",
        "median step (ms)",
        "images/s",
        "speed vs 32-true",
        "peak mem (MB)",
        "mem vs 32-true",
        "step vs no ckpt",
        "mem vs no ckpt",
        "test acc",
        "skipped steps",
        "note",
    ]
    table = []
    for r in main:
        if "skipped" in r:
            table.append([r["mode"], r["checkpointing"], *[None] * 9, f"skipped: {r['skipped']}"])
            continue
        r32, r0 = ref.get(r["checkpointing"], {}), plain.get(r["mode"], {})
        table.append(
            [
                r["mode"],
                r["checkpointing"],
                r["step_ms"],
                r["images_per_sec"],
                _ratio(r["images_per_sec"], r32.get("images_per_sec")),
                r["peak_memory_mb"],
                _ratio(r["peak_memory_mb"], r32.get("peak_memory_mb")),
                _ratio(r["step_ms"], r0.get("step_ms")) if r["checkpointing"] else None,
                _ratio(r["peak_memory_mb"], r0.get("peak_memory_mb"))
                if r["checkpointing"]
                else None,
                r["test_acc"],
                r["skipped_steps"],
                f"max batch {r['max_batch_size']}" if "max_batch_size" in r else "",
            ]
        )
    mem = (
        "torch.cuda.max_memory_allocated" if device == "cuda" else "peak RSS of the case's process"
    )
    text = [
        f"# Precision benchmark: {model}, batch {bench.data.batch_size}, {device}\n",
        f"Median step time over each case's training steps after the first {bench.warmup_steps}; "
        f"images/s = batch / median step; peak memory = {mem}; test accuracy after "
        f"{bench.trainer.max_epochs} epoch(s).\n\n",
        report.markdown(cols, table),
    ]
    if finder_note:
        text.append(f"\nLargest batch size per mode: {finder_note}.\n")
    over = [
        (r, plain.get(r["mode"], {})) for r in rows if not r["diagnostics"] and "skipped" not in r
    ]
    if over:
        text.append("\n## PrecisionDiagnostics overhead\n\n")
        text.append(
            report.markdown(
                ["mode", "step with (ms)", "step without (ms)", "ratio with/without"],
                [
                    [
                        r["mode"],
                        w.get("step_ms"),
                        r["step_ms"],
                        _ratio(w.get("step_ms"), r["step_ms"]),
                    ]
                    for r, w in over
                ],
            )
        )
    (out_dir / "bench_precision.md").write_text("".join(text))
    modes = list(dict.fromkeys(r["mode"] for r in main))
    by = {(r["mode"], r["checkpointing"]): r for r in main if "skipped" not in r}
    # One baseline for every bar, so the chart shows what checkpointing saves as well.
    k0 = bench.checkpointing[0]
    base = ref.get(k0, {})
    panels = []
    for what, key in (("images/s", "images_per_sec"), ("peak memory", "peak_memory_mb")):
        series = {
            f"act. ckpt {k}": [_ratio(by.get((m, k), {}).get(key), base.get(key)) for m in modes]
            for k in bench.checkpointing
        }
        panels.append((f"{what} relative to 32-true with act. ckpt {k0}", series))
    report.grouped_bars(out_dir / "bench_precision.png", modes, panels, reference_line=1.0)


@hydra.main(version_base="1.3", config_path="../../../configs", config_name="bench_precision")
def main(cfg: DictConfig) -> None:
    with reported():
        run(cfg)


if __name__ == "__main__":
    main()
