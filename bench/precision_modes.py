"""`python -m bench.precision_modes [overrides]`: every precision mode, with and without
activation checkpointing, built as `train.py` builds a run (`cifar_amp.build`).

Per case only what the table needs: `warmup_steps` training steps, then `timed_steps` steps
timed one by one (median step time, images/s), peak memory and GradScaler skipped steps; on
GPU also the largest batch size that fits (Lightning's batch-size finder). No validation,
test or checkpoint: a few dozen steps say nothing about accuracy. `32-true-strict` is
`32-true` with `precision.tf32=false` (IEEE fp32), the baseline TF32 is measured against.
Writes bench_precision.{md,json,png} to its run dir.
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

import lightning as L
import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from lightning import Callback
from lightning.pytorch.tuner import Tuner
from omegaconf import DictConfig, OmegaConf

from bench import report
from cifar_amp import build, cli, config, metrics
from cifar_amp.callbacks.precision_diagnostics import peak_rss_mb
from cifar_amp.config import TrainConfig
from cifar_amp.errors import UserError
from cifar_amp.precision import NAMES

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "configs"  # the groups (data, model, precision, ...) are the template's
CONFIG_NAME = "precision_modes"
REFERENCE = "32-true"  # the template's default (TF32 on CUDA): the ratios' denominator
STRICT_FP32 = "32-true-strict"  # 32-true with TF32 off; the same as 32-true off CUDA


@dataclass
class BenchConfig(TrainConfig):
    # Precision names, or 32-true-strict.
    modes: list = field(
        default_factory=lambda: [
            STRICT_FP32,
            REFERENCE,
            "16-mixed",
            "bf16-mixed",
            "16-true",
            "bf16-true",
        ]
    )
    checkpointing: list = field(default_factory=lambda: [0, 1])  # model.activation_checkpointing
    warmup_steps: int = 5  # untimed training steps first (allocator, cudnn autotuning)
    timed_steps: int = 20  # then this many steps, each timed with a device sync
    # Modes also run (checkpointing off) without PrecisionDiagnostics, to show what it costs.
    overhead_modes: list = field(default_factory=lambda: [REFERENCE, "16-mixed"])
    # Each case in a fresh process: peak RSS (CPU) never resets, and GPU memory that one mode's
    # allocator caches must not count against the next.
    isolate: bool = True
    find_batch_size: bool = True  # GPU only: largest batch that fits, per mode
    batch_size_trials: int = 8  # doublings the finder may try from data.batch_size


BENCH_KEYS = {f.name for f in fields(BenchConfig)} - {f.name for f in fields(TrainConfig)}


def register() -> None:
    """The template's schemas, this command's schema and its config (bench/
    configs_precision_modes.yaml, whose groups come from configs/). Idempotent."""
    config.register()
    cs = ConfigStore.instance()
    cs.store(name="precision_modes_schema", node=BenchConfig)
    cs.store(name=CONFIG_NAME, node=OmegaConf.load(HERE / "configs_precision_modes.yaml"))


def precision_of(mode: str) -> dict:
    return {"name": REFERENCE, "tf32": False} if mode == STRICT_FP32 else {"name": mode}


def check(cfg: DictConfig) -> None:
    valid = (STRICT_FP32, *NAMES)
    for key in ("modes", "overhead_modes"):
        bad = [m for m in cfg[key] if m not in valid]
        if bad:
            raise UserError(f"{key}: {bad}; valid: {', '.join(valid)}")
    if not cfg.modes:
        raise UserError("modes: empty; give at least one precision mode")
    if not cfg.checkpointing or any(k < 0 for k in cfg.checkpointing):
        raise UserError(f"checkpointing: {list(cfg.checkpointing)}; must be values >= 0")
    if any(cfg.checkpointing) and "activation_checkpointing" not in cfg.model:
        raise UserError(
            f"checkpointing: model {cfg.model._target_} has no activation_checkpointing; "
            "use checkpointing=[0] or model=resnet18|small_cnn"
        )
    for key, low in (("warmup_steps", 0), ("timed_steps", 1), ("batch_size_trials", 1)):
        if cfg[key] < low:
            raise UserError(f"{key}: {cfg[key]}; must be >= {low}")


class StepTimer(Callback):
    """Wall time of every training step (forward, backward, optimizer step, callbacks).
    Benchmark only: it synchronises the device around each step, which timing one needs."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.seconds.append(time.perf_counter() - self._t0)


def parts(cfg: DictConfig):
    """Precision, DataModule and LightningModule, as `cifar_amp.training.train` builds them."""
    prec = build.precision(cfg)
    layout = prec.channels_last(build.device_type(cfg))
    dm = build.datamodule(cfg, channels_last=layout)
    return prec, dm, build.module(cfg, dm.num_classes, channels_last=layout)


def largest_batch(cfg: DictConfig, trials: int) -> int:
    prec, dm, module = parts(cfg)
    return Tuner(build.trainer(cfg, prec)).scale_batch_size(
        module, datamodule=dm, mode="binsearch", init_val=cfg.data.batch_size, max_trials=trials
    )


def cannot_run(cfg: DictConfig) -> str | None:
    """Why this device cannot train the model in this precision (None if it can): one
    forward and backward of two images under the trainer's precision plugin."""
    plugin = build.trainer(cfg).precision_plugin
    device = build.device_type(cfg)
    try:
        with plugin.module_init_context():
            net = instantiate(cfg.model, num_classes=10).to(device)
        x = plugin.convert_input(torch.randn(2, 3, 32, 32, device=device))
        with plugin.forward_context():
            out = net(x)
        out.float().sum().backward()
    except (RuntimeError, NotImplementedError, TypeError) as e:  # e.g. no kernel for the dtype
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first}"[:160]
    return None


def run_case(case: dict, warmup: int, find_batch_size: int) -> dict:
    """Time one case (a plain, resolved config dict), or say why the device cannot run it."""
    cfg = OmegaConf.create(case)
    reason = cannot_run(cfg)
    if reason:
        log.warning("%s skipped: %s", cfg.precision.name, reason)
        return {"skipped": reason}
    cuda = build.device_type(cfg) == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    prec, dm, module = parts(cfg)
    timer = StepTimer()
    trainer = build.trainer(cfg, prec, [*build.callbacks(cfg), timer], [])
    trainer.fit(module, datamodule=dm)
    timed = timer.seconds[warmup:]
    skipped = trainer.callback_metrics.get(metrics.SKIPPED_STEPS)
    out = {
        "step_ms": 1000 * statistics.median(timed),
        "timed_steps": len(timed),
        "images_per_sec": cfg.data.batch_size / statistics.median(timed),
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb(),
        "skipped_steps": None if skipped is None else int(skipped),
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
    check(cfg)
    # Unresolved, so that `${run_dir}/...` paths follow each case's own run_dir.
    base = {
        k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k not in BENCH_KEYS
    }
    # A fixed number of steps, and nothing the table does not read: no validation, no
    # checkpoint, of the callbacks only PrecisionDiagnostics (its skipped-steps count).
    base["trainer"].update(
        max_steps=cfg.warmup_steps + cfg.timed_steps,
        max_epochs=-1,
        limit_val_batches=0,
        enable_checkpointing=False,
    )
    diagnostics_cb = base["callbacks"].get("precision_diagnostics")
    out_dir = Path(cfg.run_dir)
    cuda = build.device_type(cfg) == "cuda"
    finder = cfg.batch_size_trials if cfg.find_batch_size and cuda else 0
    plan = [(m, k, True) for m in cfg.modes for k in cfg.checkpointing]
    plan += [(m, 0, False) for m in cfg.overhead_modes]
    rows = []
    for mode, every, diagnostics in plan:
        case = copy.deepcopy(base)
        case["precision"].update(precision_of(mode))
        if "activation_checkpointing" in case["model"]:
            case["model"]["activation_checkpointing"] = every
        case["run_dir"] = str(out_dir / f"{mode}_ckpt{every}{'' if diagnostics else '_nodiag'}")
        on = diagnostics and diagnostics_cb
        case["callbacks"] = {"precision_diagnostics": diagnostics_cb} if on else {}
        log.info("Case %s, activation_checkpointing=%d, diagnostics=%s", mode, every, diagnostics)
        case = OmegaConf.to_container(OmegaConf.create(case), resolve=True)
        res = _run(
            run_case,
            case,
            cfg.warmup_steps,
            finder if diagnostics and every == 0 else 0,
            isolate=cfg.isolate,
        )
        rows.append({"mode": mode, "checkpointing": every, "diagnostics": diagnostics, **res})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_precision.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_report(
        rows,
        cfg,
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
    bench: DictConfig,
    model: str,
    out_dir: Path,
    device: str,
    finder_note: str | None,
) -> None:
    main = [r for r in rows if r["diagnostics"]]
    ref = {r["checkpointing"]: r for r in main if r["mode"] == REFERENCE and "skipped" not in r}
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
        "skipped steps",
        "note",
    ]
    table = []
    for r in main:
        if "skipped" in r:
            table.append([r["mode"], r["checkpointing"], *[None] * 8, f"skipped: {r['skipped']}"])
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
                r["skipped_steps"],
                f"max batch {r['max_batch_size']}" if "max_batch_size" in r else "",
            ]
        )
    mem = (
        "torch.cuda.max_memory_allocated" if device == "cuda" else "peak RSS of the case's process"
    )
    text = [
        f"# Precision benchmark: {model}, batch {bench.data.batch_size}, {device}\n",
        f"Median time of {bench.timed_steps} training steps after {bench.warmup_steps} "
        f"warm-up steps; images/s = batch / median step; peak memory = {mem}. "
        f"{STRICT_FP32} is {REFERENCE} with precision.tf32=false"
        f"{'' if device == 'cuda' else ' (TF32 exists on CUDA only: the same maths here)'}.\n\n",
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


def main() -> None:
    register()
    cli.main(run, CONFIGS, CONFIG_NAME)


if __name__ == "__main__":
    main()
