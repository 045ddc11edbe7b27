import json
import logging
import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from cifar_amp import metrics
from cifar_amp.extras.diagnostics import compat
from cifar_amp.extras.diagnostics import diagnostics as D
from cifar_amp.training import train
from conftest import requires_cuda

# What autocast makes of each mode follows the CPU's kernels: make test-avx2 runs them capped.
pytestmark = pytest.mark.native

DIAG = "+callbacks.precision_diagnostics._target_=cifar_amp.extras.diagnostics.diagnostics.PrecisionDiagnostics"


def _run(make_cfg, run_dir, *overrides):
    train(make_cfg("callbacks=none", DIAG, "test=false", "module.scheduler=null", *overrides))
    return json.loads((run_dir / "metrics.json").read_text())


def test_fp16_overflow_shows_as_skipped_steps_and_lower_scale(make_cfg, tmp_path):
    # A loss scale of 2^32 overflows float16 gradients; the scaler halves it on every
    # skipped step and never grows it here (growth_interval > steps), so
    # final scale = init * 0.5^skipped exactly.
    init = 2.0**32
    out = _run(
        make_cfg,
        tmp_path,
        "precision=16-mixed",
        f"precision.scaler.init_scale={init}",
        "precision.scaler.growth_interval=1000",
        "data.batch_size=4",
    )
    skipped, scale = out[D.SKIPPED_STEPS], out[D.SCALE]
    assert skipped >= 1
    assert scale < init
    assert scale == init * 0.5**skipped
    assert skipped < 45  # it recovered: later steps (of 45) were applied
    assert math.isfinite(out[D.GRAD_NORM]) and out[D.GRAD_NORM] > 0


def test_no_overflow_no_skipped_steps(make_cfg, tmp_path):
    out = _run(
        make_cfg,
        tmp_path,
        "precision=16-mixed",
        "precision.scaler.init_scale=256",
        "precision.scaler.growth_interval=1000",
        "trainer.limit_train_batches=5",
    )
    assert out[D.SKIPPED_STEPS] == 0
    assert out[D.SCALE] == 256


@pytest.mark.parametrize("clip, fraction", [(1e-6, 1.0), (1e6, 0.0)])
def test_clip_fraction_and_norm_before_clipping(make_cfg, tmp_path, clip, fraction):
    out = _run(
        make_cfg, tmp_path, f"trainer.gradient_clip_val={clip}", "trainer.limit_train_batches=4"
    )
    assert out[D.CLIP_FRACTION] == fraction
    # The norm is taken before clipping: far above a 1e-6 clip threshold.
    assert out[D.GRAD_NORM] > 1e-3


def test_clip_fraction_by_value(make_cfg, tmp_path):
    out = _run(
        make_cfg,
        tmp_path,
        "trainer.gradient_clip_val=1e-9",
        "trainer.gradient_clip_algorithm=value",
        "trainer.limit_train_batches=3",
    )
    assert out[D.CLIP_FRACTION] == 1.0


def test_no_scale_without_scaler_and_perf_metrics(make_cfg, tmp_path):
    out = _run(
        make_cfg,
        tmp_path,
        "precision=bf16-mixed",
        "trainer.limit_train_batches=3",
        "trainer.gradient_clip_val=null",  # (the default trainer clips)
    )
    assert D.SCALE not in out and D.SKIPPED_STEPS not in out and D.CLIP_FRACTION not in out
    assert out[D.IMAGES_PER_SEC] > 0
    assert out[D.PEAK_MEMORY_MB] > 0


def fit_start_log(make_cfg, caplog, precision: str) -> str:
    """The log of a one-step fit with only the diagnostics callback."""
    cfg = make_cfg(
        "callbacks=none",
        DIAG,
        "test=false",
        f"precision={precision}",
        "trainer.limit_train_batches=1",
    )
    with caplog.at_level(logging.INFO):
        train(cfg)
    return caplog.text


def test_fit_start_lines(make_cfg, caplog):
    text = fit_start_log(make_cfg, caplog, "16-mixed")
    assert "Precision plugin: 16-mixed: float16 autocast" in text
    assert "GradScaler(init_scale=65536" in text
    assert (
        "Parameter dtypes: float32: 8 tensors" in text
    )  # small_cnn: 2 conv + 2 linear, with biases
    # CPU autocast runs convolutions and linear layers in float16, ReLU follows its input.
    assert "Conv2d -> float16" in text and "Linear -> float16" in text
    assert "Gradient clipping: by norm at 2.0" in text  # the default trainer's (Lightning's None)


@pytest.mark.parametrize("prec", ["16-mixed", "16-true", "bf16-mixed", "32-true"])
def test_fit_start_says_what_float16_costs_on_cpu_and_what_to_use(make_cfg, prec, caplog):
    # 16-mixed took 14.6x as long as 32-true on a 2-core CPU, and nothing said so.
    fit_start_log(make_cfg, caplog, prec)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if prec.startswith("16"):
        assert any(
            m.startswith(f"Precision: {prec} on CPU:") and "use precision=bf16-mixed" in m
            for m in warned
        )
    else:
        assert not any("on CPU:" in m for m in warned)


def test_true_half_precision_parameters_are_counted(make_cfg, caplog):
    text = fit_start_log(make_cfg, caplog, "bf16-true")
    assert "Parameter dtypes: bfloat16: 8 tensors" in text
    assert "Conv2d -> bfloat16" in text


def test_the_fit_start_line_names_an_fsdp_plugin_and_its_scaler():
    # As the sharding extra makes them (sharding.py), built here without it.
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    plugin = FSDPPrecision("16-mixed")
    plugin.scaler = ShardedGradScaler(
        "cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7
    )
    line = D.describe_plugin(SimpleNamespace(precision_plugin=plugin, precision="16-mixed"))
    assert line == (
        "16-mixed: float16 autocast on cuda (FSDPPrecision), ShardedGradScaler(init_scale=1024, "
        "growth_factor=4, backoff_factor=0.25, growth_interval=7)"
    )
    bf16 = FSDPPrecision("bf16-mixed")
    line = D.describe_plugin(SimpleNamespace(precision_plugin=bf16, precision="bf16-mixed"))
    assert line == "bf16-mixed: bfloat16 autocast on cuda (FSDPPrecision), no GradScaler"


@pytest.mark.parametrize(
    "capability, tf32, said",
    [
        ((9, 0), False, "; TF32 off (strict IEEE float32)"),
        (
            (9, 0),
            True,
            "; TF32 on (float32 convolutions and matmuls; precision.tf32=false: strict)",
        ),
        ((7, 5), True, "; TF32 n/a (needs Ampere or newer)"),
    ],
)
def test_the_fit_start_line_says_whether_float32_runs_on_tf32(monkeypatch, capability, tf32, said):
    """On a (faked) GPU, after the core has set the switches from precision.tf32."""
    from lightning.pytorch.plugins.precision import Precision as Plain

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    cuda = SimpleNamespace(root_device=torch.device("cuda", 0))
    trainer = SimpleNamespace(strategy=cuda, precision_plugin=Plain(), precision="32-true")
    before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, tf32
    try:
        assert D.describe(trainer) == "32-true: Precision, no autocast, no GradScaler" + said
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("mode", ["bf16-mixed", "16-mixed"])
def test_a_step_clipped_by_norm_computes_the_norm_once_and_reports_it(
    make_cfg, tmp_path, monkeypatch, mode
):
    # The template's step made twice the plain loop's norm ops (bench.trace on one H200): the
    # report now takes the clipping's norm. A clip of 1e6 scales by exactly 1: the same run.
    calls = []
    foreach_norm = getattr(torch, compat.FOREACH_NORM)

    def counted(*args, **kwargs):
        calls.append(1)
        return foreach_norm(*args, **kwargs)

    monkeypatch.setattr(torch, compat.FOREACH_NORM, counted)
    common = (mode, "precision.scaler.init_scale=256", "trainer.limit_train_batches=4")
    out = {}
    for clip in ("null", "1e6"):
        calls.clear()
        run = tmp_path / clip
        out[clip] = _run(
            make_cfg,
            run,
            f"precision={mode}",
            *common[1:],
            f"trainer.gradient_clip_val={clip}",
            f"run_dir={run}",
        )
        assert len(calls) == 4  # one norm a step, whoever computes it
    assert out["1e6"][D.GRAD_NORM] == pytest.approx(out["null"][D.GRAD_NORM], rel=1e-6)
    assert out["1e6"][D.GRAD_NORM_MAX] == pytest.approx(out["null"][D.GRAD_NORM_MAX], rel=1e-6)
    assert out["1e6"][D.CLIP_FRACTION] == 0.0


def test_fused_optimizer_under_16_mixed_reports_the_unscaled_norm(make_cfg, tmp_path):
    """A fused optimizer unscales inside its step, so the hook sees scaled gradients; the
    reported norm must still be the unscaled one (same first step as a plain optimizer)."""
    norms = []
    for fused in ("null", "true"):
        run = tmp_path / fused
        train(
            make_cfg(
                "callbacks=none",
                DIAG,
                "test=false",
                "module.scheduler=null",
                "precision=16-mixed",
                "precision.scaler.init_scale=1024",
                f"module.optimizer.fused={fused}",
                "trainer.gradient_clip_val=null",  # the norm the hook sees, nothing clipped
                "trainer.limit_train_batches=1",
                f"run_dir={run}",
            )
        )
        out = json.loads((run / "metrics.json").read_text())
        assert out[D.SKIPPED_STEPS] == 0 and out[D.SCALE] == 1024
        norms.append(out[D.GRAD_NORM])
    assert math.isclose(norms[0], norms[1], rel_tol=1e-4), norms


class Tick(L.Callback):
    """A fake clock: each batch takes its time between its start and end hooks."""

    now = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        Tick.now += 10 if trainer.global_step < D.WARMUP_STEPS else 1


def test_train_seconds_count_the_warmup_at_the_later_batches_mean(make_cfg, tmp_path, monkeypatch):
    """A fake clock: the 3 warm-up batches take 10 s each, the others 1 s; compile_seconds is
    what the warm-up took beyond the mean (only with module.compile)."""
    monkeypatch.setattr(D.time, "perf_counter", lambda: Tick.now)
    out = _run(make_cfg, tmp_path, f"+callbacks.tick._target_={__name__}.Tick")
    steps = 180 // 16  # tiny data: 180 training images in batches of 16
    assert out[D.TRAIN_SECONDS] == steps  # all batches at the later batches' 1 s
    assert D.COMPILE_SECONDS not in out  # module.compile is off


@pytest.mark.gpu
@requires_cuda
def test_a_compiled_gpu_run_reports_its_compile_and_train_seconds(make_cfg, tmp_path):
    out = train(make_cfg("trainer=gpu", "module.compile=true", "trainer.max_epochs=2"))
    assert out[D.COMPILE_SECONDS] >= 0
    assert 0 < out[D.TRAIN_SECONDS] < out[metrics.FIT_SECONDS]


def test_scale_tensor_is_the_scale_without_a_sync():
    """A private torch name the callback reads: still the scale, as a device tensor."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert compat.scale(scaler) is None  # created lazily, on first use
    scaler.scale(torch.ones(()))
    scale = compat.scale(scaler)
    assert isinstance(scale, torch.Tensor) and scale.item() == scaler.get_scale() == 1024.0


def test_a_run_resumed_mid_epoch_logs_what_the_uninterrupted_run_logs(make_cfg, tmp_path):
    """The epoch in progress is in each checkpoint: resumed mid-epoch, the epoch's norms and
    clipping include the steps before the kill, and the skipped steps those since the first
    fit began (found by bench.kill_campaign: they were the resumed part's alone)."""
    from test_resume import resume_mid_epoch

    overflow = ("precision=16-mixed", f"precision.scaler.init_scale={2.0**24}")
    ref, resumed = resume_mid_epoch(
        lambda *o: make_cfg(*overflow, "trainer.gradient_clip_val=0.5", *o), tmp_path
    )
    a, b = (json.loads((run / "metrics.json").read_text()) for run in (ref, resumed))
    assert a[D.SKIPPED_STEPS] >= 1 and math.isfinite(a[D.GRAD_NORM])  # skipped before the kill
    for key in (D.GRAD_NORM, D.GRAD_NORM_MAX, D.CLIP_FRACTION, D.SKIPPED_STEPS, D.SCALE):
        assert a[key] == b[key], key
