"""The guards extra: trainer settings that would not do what was asked are refused on one line,
before anything is written."""

import lightning
import pytest

from cifar_amp.errors import UserError
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
