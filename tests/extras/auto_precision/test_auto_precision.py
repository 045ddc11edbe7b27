"""precision=auto: which modes it probes on which device, how it chooses, that its probe keeps
to its budget, and that a run really probes, records its choice, and a resume reuses it."""

from __future__ import annotations

import logging
import math
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.plugins.precision import Precision as Plugin
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from cifar_amp import build, metrics, precision
from cifar_amp.checkpoints import SETTINGS
from cifar_amp.errors import UserError
from cifar_amp.evaluation import evaluate
from cifar_amp.extras.auto_precision import autoprecision as A
from cifar_amp.module import ImageClassifier
from cifar_amp.precision import Autocast
from cifar_amp.schedules import OneCycleLR
from cifar_amp.training import build_run, train
from conftest import CPU_DDP, requires_cuda
from test_ddp import TWO_RANKS, plain
from test_host_sync import _AtenReads, _PythonReads

# The candidates follow this CPU's bfloat16/float16 instructions: make test-avx2 runs them capped.
pytestmark = pytest.mark.native


@pytest.mark.parametrize(
    "device,bf16,fp16,expected",
    [
        ("cuda", True, True, ["32-true", "bf16-mixed", "16-mixed"]),  # Ampere or newer
        ("cuda", False, True, ["32-true", "16-mixed"]),  # Volta, Turing: no bfloat16
        ("cpu", True, False, ["32-true", "bf16-mixed"]),  # float16 emulated: not probed
        ("cpu", True, True, ["32-true", "bf16-mixed", "16-mixed"]),  # native float16 (AMX-FP16)
        ("mps", False, False, ["32-true"]),
    ],
)
def test_candidates_follow_the_device_and_its_capabilities(device, bf16, fp16, expected):
    assert A.candidates(device, bf16, fp16) == expected


def measured(images_per_sec: float, finite: bool = True) -> A.Measured:
    return A.Measured(seconds=[1 / images_per_sec, 2 / images_per_sec], finite=finite, batch_size=1)


@pytest.mark.parametrize(
    "speeds,expected",
    [
        # fastest wins
        ({"32-true": 100, "bf16-mixed": 180, "16-mixed": 200}, "16-mixed"),
        # a non-finite loss rejects the fastest
        ({"32-true": 100, "bf16-mixed": 180, "16-mixed": (200, False)}, "bf16-mixed"),
        # within 5% of the fastest, the more precise mode wins
        ({"32-true": 100, "bf16-mixed": 196, "16-mixed": 200}, "bf16-mixed"),
        ({"32-true": 97, "bf16-mixed": 100}, "32-true"),
        # a CPU where bfloat16 is slower
        ({"32-true": 150, "bf16-mixed": 60}, "32-true"),
        # nothing finite: the safest mode (the run's own non-finite check then stops it)
        ({"32-true": (100, False), "bf16-mixed": (150, False)}, "32-true"),
    ],
)
def test_choose_takes_the_fastest_finite_mode(speeds, expected):
    found = {
        k: measured(*(v if isinstance(v, tuple) else (v,)))  # (images/s, finite)
        for k, v in speeds.items()
    }
    assert A.choose(found) == expected


class Sleepy(L.LightningModule):
    """A step takes 2 ms per image; a NaN loss in mode `nan_in` (checked through autocast)."""

    def __init__(self, nan_in: torch.dtype | None = None) -> None:
        super().__init__()
        self.layer, self.nan_in, self.slept = nn.Linear(4, 2), nan_in, 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        time.sleep(0.002 * len(x))
        self.slept += 0.002 * len(x)
        loss = F.cross_entropy(self.layer(x), y)
        if torch.get_autocast_dtype("cpu") == self.nan_in and torch.is_autocast_enabled("cpu"):
            loss = loss * float("nan")
        return loss


def test_probe_keeps_to_its_budget_on_a_slow_step_and_rejects_nan():
    # 2 candidates x 2 steps at 64 images (0.13 s a step) would take 0.51 s: over budget.
    batch = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    prec, cpu, sleepy = A.AutoPrecision(), torch.device("cpu"), Sleepy(nan_in=torch.bfloat16)
    found = A.probe(
        sleepy,
        batch,
        ["32-true", "bf16-mixed"],
        lambda name: prec.plugin("cpu", name),
        cpu,
        budget=0.5,
    )
    # The steps' own time, not the clock's (a loaded machine only makes the probe stop sooner):
    # at most one step late (0.13 s); a probe that ignored its budget would run up to
    # MAX_TIMED_STEPS steps a candidate.
    assert sleepy.slept <= 0.5 + 0.13
    assert all(16 <= m.batch_size < 64 and m.seconds for m in found.values())  # a slice
    assert found["32-true"].finite and not found["bf16-mixed"].finite
    assert A.choose(found) == "32-true"


class ColdStart:
    """A candidate whose first step takes 1 s (kernel loading, autotuning, optimizer state) and
    every later one 1 ms, whatever its images: a GPU, where a small batch times the host."""

    def __init__(self) -> None:
        self.steps = 0

    def window(self, batch, steps: int) -> tuple[float, bool]:
        self.steps += steps
        return (1.0 if self.steps == 1 else 0.001), True


def test_the_probe_sizes_its_batch_by_warm_steps_not_the_first():
    # On an H100 the first (cold) pilot steps said a batch of 512 would not fit 20 s: the probe
    # ran at 16 images, timing the host, and chose the slowest mode.
    batch = (torch.zeros(512, 4), torch.zeros(512))
    runs = {"32-true": ColdStart(), "bf16-mixed": ColdStart()}
    fitted, warm = A._fitting(batch, runs, time.perf_counter() + 5.0)
    assert len(fitted[0]) == 512 and warm == {}  # not stepped at 512 yet: a warm-up step next


@pytest.mark.parametrize(
    "mode,fused,reads",
    [
        ("32-true", True, 1),
        ("16-mixed", True, 1),  # the fused step takes the inf flag on the device
        ("16-mixed", False, 1 + 5),  # GradScaler reads it each step, as in the run
    ],
)
def test_the_probe_steps_as_the_run_does_and_waits_once_a_window(make_cfg, mode, fused, reads):
    """The run's optimizer (fused or not) and schedule, its clipping of unscaled gradients,
    the mode's plugin and scaler, and no host read between the steps of a window (the old probe
    read the loss, and waited for the device, after every step)."""
    cfg = make_cfg(f"module.optimizer.fused={str(fused).lower()}", "data.batch_size=8")
    module = build.module(cfg, 10)
    plugin = A.AutoPrecision().plugin("cpu", mode)
    clip = (1e-3, GradClipAlgorithmType.NORM)  # well under the gradients' norm: it clips
    run = A._Candidate(module, plugin, torch.device("cpu"), clip)
    config = cfg.module.optimizer
    assert type(run.optimizer).__name__ == config._target_.rsplit(".", 1)[1]
    for key in ("lr", "momentum", "nesterov", "weight_decay"):
        assert run.optimizer.defaults[key] == pytest.approx(config[key])
    assert run.optimizer.defaults["fused"] is fused and isinstance(run.scheduler, OneCycleLR)
    assert run.scaler is getattr(plugin, "scaler", None) and run.module is not module
    batch = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    run.window(batch, 1)  # the optimizer's state
    found = []
    with _PythonReads(found), _AtenReads(found):
        seconds, finite = run.window(batch, 5)
    assert len(found) == reads and seconds > 0 and finite
    grads = [p.grad for p in run.module.parameters() if p.grad is not None]
    assert torch.nn.utils.get_total_norm(grads) <= 1e-3 * 1.01  # unscaled, then clipped


def test_a_16_mixed_candidate_whose_first_fused_step_overflows_stays_finite(make_cfg):
    # The GradScaler skips that step; torch's fused SGD would leave its momentum uninitialised
    # (empty_like), as the run's plugin does not: the candidate steps as the run does.
    module = build.module(make_cfg("data.batch_size=8"), 10)
    plugin = A.AutoPrecision(scaler={"init_scale": 2.0**60}).plugin("cpu", "16-mixed")
    run = A._Candidate(module, plugin, torch.device("cpu"), (2.0, None))
    batch = (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    assert run.window(batch, 4)[1] and plugin.scaler.get_scale() < 2.0**60  # it backed off
    momenta = [run.optimizer.state[p]["momentum_buffer"] for p in run.optimizer.state]
    assert momenta and all(m.isfinite().all() for m in momenta)
    assert all(p.isfinite().all() for p in run.module.parameters())


def test_a_run_uses_what_the_probe_chose_on_faked_capabilities(make_cfg, monkeypatch, caplog):
    """A CPU that (we pretend) has native float16, where 16-mixed is the fastest but its loss
    is not finite: bf16-mixed is chosen, installed and recorded with each candidate's speed."""
    monkeypatch.setattr(A, "native", lambda device_type: (True, True))
    probed = []

    def fake_probe(module, batch, names, plugin, device, budget, clip):
        probed.append(names)
        assert isinstance(plugin("16-mixed"), MixedPrecision) and budget == 20.0
        assert clip == (2.0, None)  # the default trainer's clipping (None: Lightning's, by norm)
        return {
            "32-true": measured(100),
            "bf16-mixed": measured(150),
            "16-mixed": measured(300, finite=False),
        }

    monkeypatch.setattr(A, "probe", fake_probe)
    with caplog.at_level(logging.INFO, logger="cifar_amp"):
        run = build_run(make_cfg("precision=auto"))
        assert run.trainer.precision == "32-true"  # until fit starts
        result = train(run.cfg)
    assert probed == [["32-true", "bf16-mixed", "16-mixed"]]
    assert result[metrics.PRECISION] == "bf16-mixed"
    probe = {k: v for k, v in result.items() if k.startswith(A.PRECISION_PROBE + "/")}
    assert probe == {
        "precision_probe/32-true": pytest.approx(100),
        "precision_probe/bf16-mixed": pytest.approx(150),
        "precision_probe/16-mixed": None,
        "precision_probe/batch": 1,  # measured()'s
    }
    assert "16-mixed 300 images/s (loss not finite) -> bf16-mixed" in caplog.text
    assert "Precision: bf16-mixed, chosen at fit start" in caplog.text


def test_auto_really_probes_records_its_choice_and_a_resume_keeps_it(
    make_cfg, tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    first = train(make_cfg("precision=auto", "precision.probe_seconds=2", f"run_dir={run_dir}"))
    chosen = first[metrics.PRECISION]
    # This CPU's own candidates: bf16-mixed only where it has bfloat16 instructions.
    probed = A.candidates("cpu", *precision.native("cpu"))
    assert chosen in probed
    for mode in probed:
        assert first[f"{A.PRECISION_PROBE}/{mode}"] > 0
    left_out = {"32-true", "bf16-mixed", "16-mixed"} - set(probed)
    assert not {f"{A.PRECISION_PROBE}/{mode}" for mode in left_out} & first.keys()
    # The run's batch (16: the pilot's size, so a loaded CPU cannot shrink it; the sizing of a
    # larger one is test_the_probe_sizes_its_batch_by_warm_steps_not_the_first's).
    assert first[A.PRECISION_PROBE_BATCH] == make_cfg().data.batch_size == 16
    last = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)[SETTINGS]["precision"] == chosen

    def no_probe(*args, **kwargs):
        raise AssertionError("a resume probed again")

    monkeypatch.setattr(A, "probe", no_probe)
    resumed = train(
        make_cfg(
            "precision=auto", "trainer.max_epochs=2", f"ckpt_path={last}", f"run_dir={run_dir}"
        )
    )
    assert resumed[metrics.PRECISION] == chosen and resumed[metrics.EPOCHS] == 2
    assert not any(k.startswith(A.PRECISION_PROBE) for k in resumed)
    # A resume in the other mode is refused, as with any recorded precision.
    other = {"32-true": "bf16-mixed", "bf16-mixed": "32-true"}[chosen]
    with pytest.raises(UserError, match=f"was trained with precision={chosen}"):
        build_run(make_cfg(f"precision={other}", f"ckpt_path={last}", f"run_dir={run_dir}"))
    # eval.py with precision=auto tests in the mode the checkpoint trained in.
    tested = evaluate(
        make_cfg(
            "precision=auto", f"ckpt_path={last}", f"run_dir={tmp_path / 'e'}", config_name="eval"
        )
    )
    assert tested[metrics.PRECISION] == chosen


def test_every_auto_candidate_clips_a_fused_optimizers_gradients():
    # The default recipe's fused SGD with clipping: Lightning's MixedPrecision refuses to clip it
    # (it was refused under auto); the core's plugin clips it in every mode.
    for name in A.SAFEST_FIRST:
        plugin, p = A.AutoPrecision().plugin("cpu", name), nn.Parameter(torch.ones(4))
        scaler = getattr(plugin, "scaler", None)  # 16-mixed: the gradients are scaled
        scale = scaler.scale(torch.ones(())).item() if scaler is not None else 1.0
        p.grad = torch.full((4,), 3.0 * scale)  # norm 6, unscaled
        optimizer = torch.optim.SGD([p], lr=0.1, fused=True)
        plugin.clip_gradients(optimizer, 1.0)
        assert torch.linalg.vector_norm(p.grad).item() == pytest.approx(1.0, rel=1e-4), name


def test_auto_candidates_get_their_plugins():
    # (FSDP and DeepSpeed: auto refuses them, below)
    made = {name: A.AutoPrecision().plugin("cpu", name) for name in A.SAFEST_FIRST}
    for name, plugin in made.items():
        assert plugin.precision == name
        mixed = {"16-mixed": Autocast, "bf16-mixed": Autocast}  # the core's
        assert type(plugin) is mixed.get(name, Plugin)


@pytest.mark.parametrize("strategy", [FSDPStrategy, DeepSpeedStrategy])
def test_auto_is_refused_under_sharding_strategies(strategy):
    trainer = SimpleNamespace(strategy=object.__new__(strategy))  # Lightning refuses FSDP on CPU
    with pytest.raises(UserError, match=f"precision=auto does not probe under {strategy.__name__}"):
        A.AutoPrecision().setup(trainer)


class RecordPrecision(L.Callback):
    """Writes each rank's precision mode to <out>/rank<r>.txt when training starts."""

    def __init__(self, out):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        (self.out / f"rank{trainer.global_rank}.txt").write_text(trainer.precision)


@pytest.mark.skipif(CPU_DDP != "ddp_fork", reason="fakes the ranks' probes in this process")
def test_auto_on_two_ranks_trains_both_in_rank_zeros_choice(make_cfg, tmp_path, monkeypatch):
    import torch.distributed as dist

    # The two ranks' probes disagree (as timings on two devices may): rank 0's choice wins.
    monkeypatch.setattr(A, "choose", lambda m: "bf16-mixed" if dist.get_rank() == 0 else "32-true")
    cfg = make_cfg(
        *TWO_RANKS,
        "precision=auto",
        "precision.probe_seconds=1",
        "trainer.max_steps=1",
        "callbacks=none",
        "test=false",
    )
    module = ImageClassifier(net=plain(cfg.model), num_classes=10, optimizer=cfg.module.optimizer)
    trainer = build.trainer(cfg, callbacks=[RecordPrecision(tmp_path)], loggers=[])
    trainer.fit(module, datamodule=build.datamodule(cfg))
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["bf16-mixed"] * 2


@pytest.mark.gpu
@requires_cuda
def test_auto_probes_this_gpus_modes_and_trains_in_its_choice(make_cfg):
    """The probe's candidates on this GPU, the chosen plugin installed, channels_last (the
    layout of its 16-bit candidates), each candidate's speed recorded; whether the choice is
    the fastest at a real size is bench-gpu's (`python -m bench.gpu --sections precision,auto`)."""
    from test_gpu import ON_CUDA, Record, fit

    cfg = make_cfg(
        *ON_CUDA,
        "precision=auto",
        # Ample: the pilot's cold first steps (CUDA context, cuDNN autotuning) count against
        # it, and at 5 s an H200 once sized the probe down to the 16-image pilot. The probe
        # stops after its MAX_TIMED_STEPS anyway, in well under a second at this size.
        "precision.probe_seconds=60",
        "data.batch_size=128",  # above the probe's 16-image pilot: it could have probed fewer
        "trainer.max_steps=2",
        "trainer.max_epochs=2",  # the tiny folder holds one batch of 128 an epoch
    )
    rec = Record()
    trainer, _, prec = fit(cfg, rec)
    expected = ["32-true", "16-mixed"]
    if torch.cuda.is_bf16_supported(including_emulation=False):
        expected.insert(1, "bf16-mixed")
    assert list(prec.probed) == expected and all(v > 0 for v in prec.probed.values())
    assert prec.probe_batch == cfg.data.batch_size  # the run's batch (its layout: below)
    assert prec.name in expected and trainer.precision == prec.name
    assert isinstance(trainer.precision_plugin, MixedPrecision) is (prec.name != "32-true")
    assert prec.channels_last and rec.batches_nhwc == [True] * 2
    assert all(math.isfinite(v) for v in rec.losses)
