"""The guards extra: trainer settings that would not do what was asked are refused on one line,
before anything is written."""

from types import SimpleNamespace

import lightning
import pytest
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy

from cifar_amp.errors import UserError
from cifar_amp.extras.guards import guards
from cifar_amp.precision import Precision
from cifar_amp.training import train
from test_cli import run


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.devices=4096"], "trainer.devices=4096: only"),
        (
            ["trainer.strategy=ddp"],
            "trainer.strategy=ddp with trainer.devices=1 on CPU is a single",
        ),
    ],
)
def test_more_cpu_processes_than_cores_or_ddp_of_one(make_cfg, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        train(make_cfg(*overrides))
    assert not (tmp_path / "config.yaml").exists()  # refused before the run dir was used


@pytest.mark.parametrize("accelerator", ["gpu", "cuda", "mps", "tpu"])
def test_a_device_asked_where_there_is_none(make_cfg, monkeypatch, accelerator):
    for name in ("CUDAAccelerator", "MPSAccelerator", "XLAAccelerator"):
        monkeypatch.setattr(
            getattr(lightning.pytorch.accelerators, name),
            "is_available",
            staticmethod(lambda: False),
        )
    with pytest.raises(
        UserError,
        match=f"this run needs a {accelerator} device \\(trainer.accelerator={accelerator}\\) "
        "and none is visible here; .* add trainer=cpu",
    ):
        train(make_cfg(f"trainer.accelerator={accelerator}"))


@pytest.mark.parametrize("devices", ["2", "'2'"])  # an int, a string
def test_several_devices_with_a_one_device_strategy_are_refused(make_cfg, devices):
    # Lightning used one of them and said nothing.
    cfg = make_cfg(f"trainer.devices={devices}", "trainer.strategy=single_device")
    with pytest.raises(UserError, match="with trainer.strategy=single_device: that strategy runs"):
        train(cfg)


@pytest.mark.slow
def test_a_gpu_option_without_a_gpu_is_one_line_naming_it(tmp_path):
    r = run(
        "train.py",
        "trainer=gpu",
        f"hydra.run.dir={tmp_path}/run",
        tmp_path=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr[-2000:]
    assert r.stderr.startswith("error: trainer=gpu needs a gpu device (trainer.accelerator=gpu)")
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork_find_unused_parameters_true"])
def test_train_from_python_refuses_ranks_started_per_stage(make_cfg, tmp_path, strategy):
    # From a command they are started once (test_ddp_spawn_..._like_ddp); from Python they
    # cannot be, and the run would lose its CSV log and epoch count.
    cfg = make_cfg("trainer.devices=2", f"trainer.strategy={strategy}", f"run_dir={tmp_path}/run")
    with pytest.raises(UserError, match=f"trainer.strategy={strategy}: ranks started by"):
        train(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val: -1; must be >= 0"),
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches: 0; must be >= 1"),
    ],
)
def test_a_negative_clip_or_no_accumulation_is_refused(make_cfg, tmp_path, override, message):
    with pytest.raises(UserError, match=f"invalid config value for {message}"):
        train(make_cfg(override))
    assert not (tmp_path / "config.yaml").exists()


def test_bf16_on_a_gpu_without_bf16(make_cfg, monkeypatch, tmp_path):
    # autocast would fall back to float32, with a warning
    for name, value in {
        "is_available": True,
        "device_count": 1,
        "is_bf16_supported": False,
        "get_device_name": "Tesla V100",
    }.items():
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value, **k: v)
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    with pytest.raises(
        UserError,
        match="precision=bf16-mixed: Tesla V100 has no bfloat16 support; valid here: 16-mixed",
    ):
        train(make_cfg("trainer=gpu", "precision=bf16-mixed"))
    assert not (tmp_path / "config.yaml").exists()


def test_16_mixed_under_lightnings_deepspeed_is_refused():
    # DeepSpeed takes the core's 16-mixed plugin, and its engine bypasses it: the scaler
    # settings would be lost. (The sharding extra's trainer=deepspeed makes its own plugin.)
    on_cpu = type("DeepSpeedStrategy", (DeepSpeedStrategy,), {"root_device": torch.device("cpu")})
    deepspeed = object.__new__(on_cpu)  # its constructor needs deepspeed installed
    deepspeed.precision_plugin = Precision("16-mixed").plugin("cpu")
    trainer = SimpleNamespace(
        strategy=deepspeed, precision_plugin=deepspeed.precision_plugin, precision="16-mixed"
    )
    with pytest.raises(
        UserError,
        match="precision=16-mixed with DeepSpeedStrategy would lose precision.scaler; use "
        "trainer=deepspeed",
    ):
        guards._precision(trainer)
