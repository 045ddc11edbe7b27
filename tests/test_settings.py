"""One place per setting: schemas come from the constructors, every Trainer argument works,
a user's DataModule plugs in with one YAML file, old checkpoints still resume."""

from __future__ import annotations

import inspect
import shutil
import sys

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException

from cifar_amp import build, config, metrics
from cifar_amp.data.cifar import CIFARDataModule
from cifar_amp.module import ImageClassifier
from cifar_amp.precision import Precision
from cifar_amp.training import build_run, train
from conftest import CONFIGS, REPO, SHRINK, compose_cfg

LEGACY_CKPT = REPO / "tests" / "assets" / "legacy-last.ckpt"


def default(cls, name):
    return inspect.signature(cls).parameters[name].default


def test_defaults_come_from_the_constructors():
    cfg = compose_cfg("train", ["run_dir=/tmp/unused"])
    assert cfg.data.batch_size == default(CIFARDataModule, "batch_size")
    assert cfg.data.val_split == default(CIFARDataModule, "val_split")
    assert cfg.module.label_smoothing == default(ImageClassifier, "label_smoothing")
    assert cfg.module.optimizer.dampening == default(torch.optim.SGD, "dampening")
    assert cfg.module.scheduler.div_factor == default(
        torch.optim.lr_scheduler.OneCycleLR, "div_factor"
    )
    assert cfg.precision.scaler.init_scale == default(torch.amp.GradScaler, "init_scale")
    assert cfg.trainer.inference_mode == default(L.Trainer, "inference_mode")


@pytest.mark.parametrize(
    "override", ["trainer.profiler=simple", "trainer.overfit_batches=1", "trainer.min_epochs=2"]
)
def test_every_trainer_argument_is_accepted(make_cfg, override):
    cfg = make_cfg(override)
    key, value = override.split("=")
    trainer = build.trainer(cfg, build.precision(cfg), [], [])
    assert str(cfg.trainer[key.split(".")[1]]) == value
    assert trainer is not None


def test_a_trainer_typo_names_the_close_match():
    from cifar_amp.cli import check_overrides

    with pytest.raises(SystemExit) as e:
        check_overrides(["trainer.min_epoch=2"], CONFIGS, "train")
    assert e.value.code == 2


@pytest.mark.parametrize("override", ["precision.tf32=maybe", "precision.channels_last=abc"])
def test_precision_settings_are_typed(make_cfg, override):
    with pytest.raises(ConfigCompositionException):
        make_cfg(override)


@pytest.mark.parametrize(
    "name,tf32,device,expected",
    [
        # CUDA: each mode's faster layout on an H100 (docs/benchmarks-gpu.md)
        ("16-mixed", True, "cuda", True),
        ("bf16-mixed", True, "cuda", True),
        ("16-true", True, "cuda", True),
        ("bf16-true", True, "cuda", True),
        ("32-true", True, "cuda", True),  # TF32's tensor cores: 1.57x NCHW's speed
        ("32-true", False, "cuda", False),  # strict fp32: NCHW 1.4% faster
        ("64-true", True, "cuda", False),  # no tensor cores
        ("16-mixed", False, "cuda", True),  # tf32 is 32-true's alone
        ("16-mixed", True, "cpu", False),  # float16 on CPU: NHWC is slower
        ("32-true", True, "cpu", True),  # oneDNN's convolutions run NHWC
        ("32-true", False, "cpu", True),
        ("bf16-mixed", True, "cpu", True),
        ("bf16-mixed", True, "mps", False),
    ],
)
def test_channels_last_follows_the_precision_unless_set(name, tf32, device, expected):
    assert Precision(name, tf32=tf32).channels_last_on(device) is expected
    flipped = Precision(name, channels_last=not expected, tf32=tf32)
    assert flipped.channels_last_on(device) is (not expected)


def precision_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Precision: ")]


def test_tf32_is_explicit_and_reported(make_cfg, caplog):
    """Set up for a (faked) GPU: the switches follow precision.tf32 and the log says so."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        with caplog.at_level("INFO", logger="cifar_amp.precision"):
            Precision("32-true", tf32=False).setup(trainer)
            assert not torch.backends.cudnn.allow_tf32
            assert not torch.backends.cuda.matmul.allow_tf32
            Precision("32-true", tf32=True).setup(trainer)
            assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
    assert precision_lines(caplog) == [  # each with its faster layout
        "Precision: 32-true, layout NCHW, TF32 off",
        "Precision: 32-true, layout channels_last, TF32 on",
    ]
    caplog.clear()
    cfg = make_cfg()
    with caplog.at_level("INFO", logger="cifar_amp.precision"):
        build.trainer(cfg, build.precision(cfg))
        build.trainer(cfg, build.precision(make_cfg("precision.channels_last=false")))
    assert precision_lines(caplog) == [
        "Precision: 32-true, layout channels_last",  # no TF32 off CUDA
        "Precision: 32-true, layout NCHW",
    ]


def test_the_layout_is_stated_and_a_datamodule_that_cannot_follow_is_named(make_cfg, caplog):
    cfg = make_cfg("precision=bf16-mixed", "precision.channels_last=true")
    with caplog.at_level("INFO", logger="cifar_amp.precision"):
        build.trainer(cfg, build.precision(cfg), [], [])
    assert precision_lines(caplog) == ["Precision: bf16-mixed, layout channels_last"]
    cfg.data = {"_target_": "lightning.pytorch.demos.boring_classes.BoringDataModule"}
    with caplog.at_level("WARNING", logger="cifar_amp.build"):
        build.datamodule(cfg, channels_last=True)
    assert "BoringDataModule takes no channels_last argument" in caplog.text


def test_a_users_datamodule_plugs_in_with_one_yaml_file(tmp_path):
    """docs/fork.md's worked example: a class of the user's and configs/data/noise.yaml."""
    configs = shutil.copytree(CONFIGS, tmp_path / "configs")
    (configs / "data" / "noise.yaml").write_text(
        "_target_: noise_datamodule.NoiseDataModule\nnum_classes: 4\nsize: 256\nbatch_size: 16\n"
    )
    sys.path.insert(0, str(REPO / "tests" / "examples"))
    try:
        from hydra import compose, initialize_config_dir

        config.register(configs)
        with initialize_config_dir(str(configs), version_base="1.3"):
            cfg = compose(
                "train",
                [
                    *(o for o in SHRINK if not o.startswith("data.")),
                    "data=noise",
                    f"run_dir={tmp_path / 'run'}",
                    "data.size=160",
                ],
            )
        result = train(cfg)
    finally:
        sys.path.remove(str(REPO / "tests" / "examples"))
    assert 0.0 <= result[metrics.TEST_ACC] <= 1.0
    ckpt = torch.load(result["tested_ckpt"], map_location="cpu", weights_only=False)
    assert ckpt["hyper_parameters"]["num_classes"] == 4


def test_a_checkpoint_of_the_previous_layout_still_resumes(make_cfg, tmp_path):
    """tests/assets/legacy-last.ckpt: written before settings moved into the constructors
    (16-mixed, small_cnn on the tiny folder, epoch 1 of 2)."""
    ckpt = shutil.copy(LEGACY_CKPT, tmp_path / "legacy.ckpt")
    cfg = make_cfg(
        "precision=16-mixed",
        "trainer.max_epochs=2",
        "trainer.deterministic=true",
        f"ckpt_path={ckpt}",
    )
    result = train(cfg)
    assert result[metrics.EPOCHS] == 2
    last = torch.load(
        tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
    )
    assert last["global_step"] == 2 * torch.load(ckpt, weights_only=False)["global_step"]


def test_the_device_comes_from_the_accelerator_so_mps_stays_mps(monkeypatch):
    """The Trainer is built with a float16 autocast plugin for the device its accelerator
    names, by Lightning's own choice for auto and gpu: an Apple GPU gets `mps`, not `cpu` (and
    no TF32 switch, no channels_last)."""
    from types import SimpleNamespace

    from lightning.fabric.accelerators.mps import MPSAccelerator

    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: True))
    prec = Precision("16-mixed")
    for accelerator in ("mps", "gpu", "auto"):
        [plugin] = prec.trainer_args(accelerator, "auto")["plugins"]
        assert plugin.device == "mps", accelerator
    mps = SimpleNamespace(root_device=torch.device("mps"))
    prec.setup(SimpleNamespace(strategy=mps, precision_plugin=plugin))
    assert prec.channels_last is False


def test_a_run_lays_out_its_network_and_batches_as_its_precision_decides(make_cfg):
    """build_run builds the network after the Trainer, whose precision decides the layout."""
    run = build_run(make_cfg("precision=32-true"))  # channels_last on CPU
    assert run.precision.channels_last is True and run.datamodule.channels_last is True
    weight = next(p for p in run.module.net.parameters() if p.dim() == 4)
    assert weight.is_contiguous(memory_format=torch.channels_last)
