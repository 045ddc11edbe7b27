"""`python -m bench.precision_modes [overrides]`: every precision mode, with and without
activation checkpointing, built as `train.py` builds a run (`cifar_amp.build`).

Per case only what the table needs: `warmup_steps` training steps, then `timed_steps` steps
timed as one window (mean step time, images/s), peak memory over the timed steps and GradScaler
skipped steps; the memory of a step by kind (weights + gradients + optimizer state, and
activations), traced on fake tensors (bench/memory.py); on GPU also the largest batch that
trains, per mode. No validation, test or checkpoint: a few dozen steps say nothing about
accuracy. `32-true-strict` is `32-true` with `precision.tf32=false` (IEEE fp32), the baseline
TF32 is measured against. Writes bench_precision.{md,json,png} to its run dir.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import multiprocessing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from lightning import Callback
from omegaconf import DictConfig, OmegaConf

from bench import memory, report
from cifar_amp import build, cli, config
from cifar_amp.config import TrainConfig
from cifar_amp.errors import UserError
from cifar_amp.extras.diagnostics.diagnostics import SKIPPED_STEPS, peak_rss_mb
from cifar_amp.precision import NAMES

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "configs"  # the groups (data, model, precision, ...) are the template's
CONFIG_NAME = "precision_modes"
REFERENCE = "32-true"  # the template's default (TF32 on CUDA): the ratios' denominator
STRICT_FP32 = "32-true-strict"  # 32-true with TF32 off; the same as 32-true off CUDA
MB = 2**20


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
    # Activation checkpointing settings: k = model.activation_checkpointing=k (every k-th
    # block; 0 = off), a list = model.checkpoint_stages (every block of those stages).
    checkpointing: list = field(default_factory=lambda: [0, 1, [0, 1]])
    warmup_steps: int = 5  # untimed training steps first (allocator, cudnn autotuning)
    timed_steps: int = 20  # then this many steps, timed as one window (synced at its ends)
    # Modes also run (checkpointing off) without PrecisionDiagnostics, to show what it costs.
    overhead_modes: list = field(default_factory=lambda: [REFERENCE, "16-mixed"])
    # Each case in a fresh process. null: only on CPU, where a process's peak RSS cannot be
    # reset; on CUDA the cases share one process (and its loaded data), peak stats reset.
    isolate: Optional[bool] = None
    timing: bool = True  # false: only the memory breakdown (any machine, about 1 s per case)
    memory_breakdown: bool = True  # weights/grads/optimizer vs activations (bench/memory.py)
    find_batch_size: bool = True  # GPU only: largest batch that trains, per mode
    batch_size_trials: int = 4  # training runs (2 steps each) the search may make per mode


BENCH_KEYS = {f.name for f in fields(BenchConfig)} - {f.name for f in fields(TrainConfig)}


def register() -> None:
    """The template's schemas, this command's schema and its config (bench/
    configs_precision_modes.yaml, whose groups come from configs/). Idempotent."""
    config.register(CONFIGS, {CONFIG_NAME: BenchConfig})
    cs = ConfigStore.instance()
    cs.store(name=CONFIG_NAME, node=OmegaConf.load(HERE / "configs_precision_modes.yaml"))


def precision_of(mode: str) -> dict:
    return {"name": REFERENCE, "tf32": False} if mode == STRICT_FP32 else {"name": mode}


def model_args(setting) -> dict:
    """The model arguments of one `checkpointing` entry."""
    if isinstance(setting, int):
        return {"activation_checkpointing": setting}
    return {"checkpoint_stages": list(setting)}


def label(setting) -> str:
    if isinstance(setting, int):
        return "off" if setting == 0 else f"every {setting}"
    return "stages " + ",".join(map(str, setting))


def check(cfg: DictConfig) -> None:
    valid = (STRICT_FP32, *NAMES)
    for key in ("modes", "overhead_modes"):
        bad = [m for m in cfg[key] if m not in valid]
        if bad:
            raise UserError(f"{key}: {bad}; valid: {', '.join(valid)}")
    if not cfg.modes:
        raise UserError("modes: empty; give at least one precision mode")
    settings = OmegaConf.to_container(cfg.checkpointing)
    if not settings or any(
        not (isinstance(s, int) and s >= 0)
        and not (isinstance(s, list) and all(isinstance(i, int) for i in s))
        for s in settings
    ):
        raise UserError(
            f"checkpointing: {settings}; each entry: k >= 0 (every k-th block, 0 = off) "
            "or a list of stage indices"
        )
    for s in settings:
        if s == 0:
            continue
        (arg,) = model_args(s)
        if arg not in cfg.model:
            raise UserError(
                f"checkpointing: model {cfg.model._target_} has no {arg}; "
                "use checkpointing=[0] or model=resnet18|speednet|small_cnn"
            )
        if isinstance(s, list):  # stage indices are the model's to check, by config key
            build.build({**cfg.model, **model_args(s)}, "model", num_classes=10)
    if not cfg.timing and not cfg.memory_breakdown:
        raise UserError("timing=false and memory_breakdown=false: nothing to measure")
    for key, low in (("warmup_steps", 0), ("timed_steps", 1), ("batch_size_trials", 1)):
        if cfg[key] < low:
            raise UserError(f"{key}: {cfg[key]}; must be >= {low}")


class StepMeter(Callback):
    """The training steps (forward, backward, optimizer step, callbacks, the loop between
    steps) after `warmup`, timed as one window, and each step's memory (bench/memory.py's
    StepWindow: the step's own peak, not what the DataModule, the warm-up or Lightning's set-up
    left on the device). The timed steps are the rest of `trainer.max_steps`."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.memory = warmup, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.memory is None:
            timed = trainer.max_steps - self.warmup
            self.memory = memory.StepWindow(trainer.strategy.root_device, self.warmup, timed)
        self.memory.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.memory.stop()


def device_type(cfg: DictConfig) -> str:
    """The device the Trainer of `cfg` picks."""
    return build.trainer(cfg).strategy.root_device.type


def parts(cfg: DictConfig, callbacks: list, datamodules: dict | None = None):
    """Trainer, DataModule and LightningModule, as `cifar_amp.training.train` builds them.
    `datamodules`: loaded ones by layout, reused (at this batch size) by cases in one process."""
    prec = build.precision(cfg)
    trainer = build.trainer(cfg, prec, callbacks)
    layout = prec.channels_last
    cached = {} if datamodules is None else datamodules
    if layout not in cached:
        cached[layout] = build.datamodule(cfg, channels_last=layout)
    dm = cached[layout]
    dm.batch_size = cfg.data.batch_size
    return trainer, dm, build.module(cfg, dm.num_classes, channels_last=layout)


def cannot_run(cfg: DictConfig) -> str | None:
    """Why this device cannot train the model in this precision (None if it can): one
    forward and backward of two images under the trainer's precision plugin."""
    trainer = build.trainer(cfg)
    plugin, device = trainer.precision_plugin, trainer.strategy.root_device.type
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


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_case(case: dict, warmup: int, datamodules: dict | None = None) -> dict:
    """Time one case (a plain, resolved config dict), or say why the device cannot run it."""
    cfg = OmegaConf.create(case)
    reason = cannot_run(cfg)
    if reason:
        log.warning("%s skipped: %s", cfg.precision.name, reason)
        return {"skipped": reason}
    cuda = device_type(cfg) == "cuda"
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    meter = StepMeter(warmup)
    trainer, dm, module = parts(cfg, [*build.callbacks(cfg), meter], datamodules)
    try:
        trainer.fit(module, datamodule=dm)
    except torch.OutOfMemoryError:
        return {"skipped": "out of memory"}
    finally:
        dm.trainer = None  # a reused DataModule must not keep this case's model alive
    if (step := meter.memory and meter.memory.step_seconds) is None:  # fit stopped early
        return {"skipped": "the run stopped before its timed steps ended"}
    skipped = trainer.callback_metrics.get(SKIPPED_STEPS)
    return {
        "step_ms": 1000 * step,
        "timed_steps": meter.memory.timed,
        "images_per_sec": cfg.data.batch_size / step,
        "peak_memory_mb": meter.memory.peak_mb if cuda else peak_rss_mb(),
        "step_peak_mb": meter.memory.step_peak_mb,
        "peak_warmup_mb": meter.memory.peak_warmup_mb,
        "base_memory_mb": meter.memory.base_mb,
        "skipped_steps": None if skipped is None else int(skipped),
        "train_images": len(dm.splits["train"][1]) if hasattr(dm, "splits") else None,
    }


def trains(case: dict, batch: int, datamodules: dict | None) -> bool:
    """Whether two training steps at `batch` fit in device memory."""
    cfg = OmegaConf.create(case)
    cfg.data.batch_size = batch
    # cuDNN autotuning off: each new batch shape would be tuned again, for a yes/no answer.
    cfg.trainer.update(max_steps=2, benchmark=False)
    trainer, dm, module = parts(cfg, [], datamodules)
    try:
        trainer.fit(module, datamodule=dm)
        fits = True
    except torch.OutOfMemoryError:
        fits = False
    dm.trainer = None
    del trainer, module
    _release()
    log.info("Batch %d %s", batch, "fits" if fits else "does not fit")
    return fits


def largest_batch(
    case: dict, per_image_mb: float, limit: int, trials: int, datamodules: dict | None = None
) -> dict:
    """The largest batch (up to `limit`, the training images) that trains, searched from
    what the timed case's memory predicts (free device memory / the step's memory per
    image). Lightning's batch-size finder would take 8 or more runs per mode from a fixed
    start, each with validation and a checkpoint; this takes at most `trials` runs of 2
    steps, which keeps the whole table within minutes."""
    datamodules = {} if datamodules is None else datamodules
    _release()
    free, _ = torch.cuda.mem_get_info()
    headroom_mb = (free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / MB
    guess = int(0.9 * headroom_mb / per_image_mb) if per_image_mb > 0 else limit
    lo, hi = memory.largest_fitting(lambda b: trains(case, b, datamodules), guess, limit, trials)
    return {"max_batch_size": lo, "failed_batch_size": hi, "batch_limit": limit}


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
    cuda = device_type(cfg) == "cuda"
    isolate = (not cuda) if cfg.isolate is None else cfg.isolate
    datamodules = None if isolate else {}  # loaded once per layout, for all cases
    settings = OmegaConf.to_container(cfg.checkpointing)
    plan = [(m, k, True) for m in cfg.modes for k in settings]
    plan += [(m, 0, False) for m in cfg.overhead_modes] if cfg.timing else []
    traced: dict = {}  # breakdowns by (precision, setting): 32-true-strict has 32-true's
    rows = []
    for mode, setting, diagnostics in plan:
        case = copy.deepcopy(base)
        case["precision"].update(precision_of(mode))
        if setting != 0:
            case["model"].update(model_args(setting))
        tag = label(setting).replace(" ", "").replace(",", "-")
        case["run_dir"] = str(out_dir / f"{mode}_{tag}{'' if diagnostics else '-nodiag'}")
        on = diagnostics and diagnostics_cb
        case["callbacks"] = {"precision_diagnostics": diagnostics_cb} if on else {}
        case = OmegaConf.to_container(OmegaConf.create(case), resolve=True)
        row = {"mode": mode, "checkpointing": setting, "diagnostics": diagnostics}
        log.info("Case %s, act. ckpt %s, diagnostics=%s", mode, label(setting), diagnostics)
        if cfg.timing:
            shared = () if isolate else (datamodules,)
            row.update(_run(run_case, case, cfg.warmup_steps, *shared, isolate=isolate))
            _release()
        if cfg.memory_breakdown and diagnostics and "skipped" not in row:
            key = (precision_of(mode)["name"], label(setting))
            if key not in traced:
                traced[key] = memory.breakdown(OmegaConf.create(case), cfg.data.batch_size)
            row.update(traced[key])
        rows.append(row)
    finder = cfg.timing and cfg.find_batch_size and cuda
    if finder:
        search_rows(rows, base, cfg, settings[0], datamodules if not isolate else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_precision.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_report(
        rows,
        cfg,
        cfg.model._target_.rsplit(".", 1)[-1],
        out_dir,
        "cuda" if cuda else "cpu",
        finder_note=None if finder else "not run (GPU only: CPU has no device memory limit)",
    )
    return rows


def search_rows(rows: list[dict], base: dict, cfg: DictConfig, setting, datamodules) -> None:
    """Adds the largest batch to each mode's row at checkpointing `setting`. 32-true-strict
    gets 32-true's: TF32 changes the speed, not the tensors. `datamodules`: None = isolated."""
    found = {}
    for row in rows:
        if row["checkpointing"] != setting or not row["diagnostics"] or "skipped" in row:
            continue
        name = precision_of(row["mode"])["name"]
        if name not in found and row.get("step_peak_mb") is not None:
            case = copy.deepcopy(base)
            case["precision"].update({"name": name})
            if setting != 0:
                case["model"].update(model_args(setting))
            case["run_dir"] = str(Path(cfg.run_dir) / f"{name}_batch_search")
            case["callbacks"] = {}
            case = OmegaConf.to_container(OmegaConf.create(case), resolve=True)
            per_image = row["step_peak_mb"] / cfg.data.batch_size
            log.info("Largest batch of %s", name)
            args = (case, per_image, row["train_images"] or 2**20, cfg.batch_size_trials)
            shared = () if datamodules is None else (datamodules,)
            found[name] = _run(largest_batch, *args, *shared, isolate=datamodules is None)
        row.update(found.get(name, {}))


def _mem(row: dict):
    """The step's own peak on CUDA, the process's peak RSS elsewhere."""
    return row.get("step_peak_mb") or row.get("peak_memory_mb")


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
    ok = [r for r in main if "skipped" not in r]
    by = {(r["mode"], label(r["checkpointing"])): r for r in ok}
    settings = list(dict.fromkeys(label(r["checkpointing"]) for r in main))
    cols = [
        "mode",
        "act. ckpt",
        "mean step (ms)",
        "images/s",
        "speed vs 32-true",
        f"speed vs {STRICT_FP32}",
        "peak mem (MB)",
        "step's own peak (MB)",
        "peak with warm-up (MB)",
        "mem vs 32-true",
        "step vs no ckpt",
        "mem vs no ckpt",
        "weights+grads+opt (MB)",
        "activations (MB)",
        "act. vs no ckpt",
        "skipped steps",
        "note",
    ]
    table = []
    for r in main:
        ck = label(r["checkpointing"])
        if "skipped" in r:
            table.append([r["mode"], ck, *[None] * (len(cols) - 3), f"skipped: {r['skipped']}"])
            continue
        ref, strict = by.get((REFERENCE, ck), {}), by.get((STRICT_FP32, ck), {})
        off = by.get((r["mode"], "off"), {}) if ck != "off" else {}
        table.append(
            [
                r["mode"],
                ck,
                r.get("step_ms"),
                r.get("images_per_sec"),
                _ratio(r.get("images_per_sec"), ref.get("images_per_sec")),
                _ratio(r.get("images_per_sec"), strict.get("images_per_sec")),
                r.get("peak_memory_mb"),
                r.get("step_peak_mb"),
                r.get("peak_warmup_mb"),
                _ratio(_mem(r), _mem(ref)),
                _ratio(r.get("step_ms"), off.get("step_ms")),
                _ratio(_mem(r), _mem(off)),
                r.get("state_mb"),
                r.get("activations_mb"),
                _ratio(r.get("activations_mb"), off.get("activations_mb")),
                r.get("skipped_steps"),
                _batch_note(r),
            ]
        )
    mem = (
        "torch.cuda.max_memory_allocated over the timed steps, each step in a window of its "
        "own (`step's own peak`: what a step adds over what was allocated at its start, which "
        "the `mem vs` ratios compare; `with warm-up`: over the warm-up steps, whose cuDNN "
        "autotuning tries algorithms with large workspaces)"
        if device == "cuda"
        else "peak RSS of the case's process"
    )
    timing = (
        f"Median time of {bench.timed_steps} training steps after {bench.warmup_steps} "
        f"warm-up steps; images/s = batch / mean step of the timed window; peak memory = {mem}. "
        if bench.timing
        else "Timing not run (timing=false). "
    )
    text = [
        f"# Precision benchmark: {model}, batch {bench.data.batch_size}, {device}\n\n",
        f"{timing}{STRICT_FP32} is {REFERENCE} with precision.tf32=false"
        f"{'' if device == 'cuda' else ' (TF32 exists on CUDA only: the same maths here)'}. "
        "Ratios: `vs 32-true` and `vs 32-true-strict` at the same act. ckpt setting, `vs no "
        "ckpt` against the same mode without it. `weights+grads+opt` and `activations` "
        "(kept for backward, recomputed ones included) are the step's tensors at its peak, "
        "traced on fake tensors: device-independent (bench/memory.py); the measured peak adds "
        "the data kept on the device, the batch, activation gradients and workspaces.\n\n",
        report.markdown(cols, table),
    ]
    if finder_note:
        text.append(f"\nLargest batch size per mode: {finder_note}.\n")
    plain = {r["mode"]: r for r in ok if label(r["checkpointing"]) == "off"}
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
    # One baseline for every bar, so the chart shows what checkpointing saves as well; without
    # 32-true among the modes, the first mode (else no bar had a baseline and the chart failed).
    ref = REFERENCE if (REFERENCE, settings[0]) in by else modes[0]
    base = by.get((ref, settings[0]), {})
    panels = []
    for what, key in (
        ("images/s", "images_per_sec"),
        ("peak memory", "peak_memory_mb"),
        ("activations", "activations_mb"),
    ):
        series = {
            f"act. ckpt {k}": [_ratio(by.get((m, k), {}).get(key), base.get(key)) for m in modes]
            for k in settings
        }
        if any(v is not None for vs in series.values() for v in vs):
            panels.append((f"{what} relative to {ref} with act. ckpt {settings[0]}", series))
    report.grouped_bars(out_dir / "bench_precision.png", modes, panels, reference_line=1.0)


def _batch_note(row: dict) -> str:
    if "batch_limit" not in row:
        return ""
    lo, hi, limit = row["max_batch_size"], row["failed_batch_size"], row["batch_limit"]
    if lo is None:
        return f"max batch < {hi}"
    if lo == limit:
        return f"max batch >= {lo} (all training images)"
    return f"max batch {lo}" + (f" (fails at {hi})" if hi else " (no failure reached)")


def main() -> None:
    register()
    cli.main(run, CONFIG_NAME, BenchConfig, entry=__spec__.name)


if __name__ == "__main__":
    main()
