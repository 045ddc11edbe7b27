"""The sharding extra: FSDP and DeepSpeed keep the precision choice with its settings. Under
`precision=16-mixed` FSDP gets its own plugin with a sharded GradScaler of `precision.scaler`,
DeepSpeed its own loss scaler from it; trainer=fsdp builds a sharding strategy. Lightning refuses
FSDP without a GPU, so the plugins are checked on the strategy objects here and trained on a GPU
below (`pytest -m gpu`)."""

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from lightning import Callback
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from cifar_amp.errors import UserError
from cifar_amp.extras.sharding.sharding import (
    DeepSpeedStrategy,
    FSDPStrategy,
    deepspeed_loss_scaler,
)
from cifar_amp.precision import Precision
from conftest import compose_cfg, requires_cuda
from test_gpu import DTYPES, Record, fit, needs

SCALER = {"init_scale": 1024.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7}


def scaler_settings(sc) -> dict:
    return {
        "init_scale": sc.get_scale(),
        "growth_factor": sc.get_growth_factor(),
        "backoff_factor": sc.get_backoff_factor(),
        "growth_interval": sc.get_growth_interval(),
    }


def core_plugin(**scaler):
    """The plugin the core's Precision.setup gives the strategy under 16-mixed."""
    return Precision("16-mixed", scaler=scaler).plugin("cpu")


def test_fsdp_takes_16_mixed_as_its_plugin_with_the_scaler_settings():
    strategy = FSDPStrategy()
    strategy.precision_plugin = core_plugin(**SCALER)
    made = strategy.precision_plugin
    assert type(made) is FSDPPrecision and made.precision == "16-mixed"
    assert type(made.scaler) is ShardedGradScaler and made.scaler.is_enabled()
    assert scaler_settings(made.scaler) == SCALER


def test_a_disabled_scaler_stays_disabled_under_fsdp():
    strategy = FSDPStrategy()
    strategy.precision_plugin = core_plugin(enabled=False)
    assert not strategy.precision_plugin.scaler.is_enabled()


def test_fsdp_keeps_lightnings_plugins_of_the_other_modes():
    strategy, bf16 = FSDPStrategy(), FSDPPrecision("bf16-mixed")
    strategy.precision_plugin = bf16
    assert strategy.precision_plugin is bf16


def test_deepspeed_scales_the_loss_itself_with_the_scaler_settings():
    strategy = object.__new__(DeepSpeedStrategy)  # its constructor needs deepspeed installed
    strategy.precision_plugin = core_plugin(growth_interval=7)
    assert type(strategy.precision_plugin) is DeepSpeedPrecision
    assert strategy.precision_plugin.precision == "16-mixed"
    assert (strategy.loss_scale, strategy.initial_scale_power, strategy.loss_scale_window) == (
        0.0,  # dynamic
        16,  # torch's init_scale 65536
        7,
    )
    assert deepspeed_loss_scaler(core_plugin(enabled=False).scaler) == {"loss_scale": 1.0}


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"init_scale": 1000.0}, "precision.scaler.init_scale: 1000.0; must be a power of 2"),
        ({"growth_factor": 3.0}, "precision.scaler.growth_factor: 3.0; must be 2"),
        ({"backoff_factor": 0.25}, "precision.scaler.backoff_factor: 0.25; must be 0.5"),
    ],
)
def test_scaler_settings_deepspeed_cannot_follow_are_refused(setting, message):
    strategy = object.__new__(DeepSpeedStrategy)
    with pytest.raises(UserError, match=message):
        strategy.precision_plugin = core_plugin(**setting)


def test_the_core_accepts_the_extras_strategies_under_16_mixed():
    # Lightning's own are refused (tests/test_bad_input.py); these make their plugin from it.
    strategy = FSDPStrategy(parallel_devices=[torch.device("cpu")])
    trainer = SimpleNamespace(strategy=strategy)
    Precision("16-mixed", scaler=SCALER).setup(trainer)
    assert type(strategy.precision_plugin) is FSDPPrecision


def test_trainer_fsdp_shards_each_block_of_a_million_parameters():
    strategy = instantiate(compose_cfg("train", ["trainer=fsdp"]).trainer.strategy)
    assert isinstance(strategy, FSDPStrategy)
    policy = strategy.kwargs["auto_wrap_policy"]
    big, small = torch.nn.Linear(1000, 1000), torch.nn.Linear(10, 10)
    assert [policy(m, recurse=False, nonwrapped_numel=m.weight.numel()) for m in (big, small)] == [
        True,
        False,
    ]


def test_trainer_deepspeed_names_the_extras_strategy():
    node = compose_cfg("train", ["trainer=deepspeed"]).trainer.strategy
    assert (
        node._target_ == "cifar_amp.extras.sharding.sharding.DeepSpeedStrategy" and node.stage == 2
    )


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("mode", ["16-mixed", "bf16-mixed"])
def test_fsdp_trains_with_the_plugin_of_the_precision_choice(make_cfg, mode, caplog):
    needs(mode)
    scaler = ["precision.scaler.init_scale=1024"] if mode == "16-mixed" else []
    cfg = make_cfg(
        "trainer=fsdp",
        "trainer.devices=1",
        "callbacks=none",
        "test=false",
        f"precision={mode}",
        *scaler,
        "trainer.max_steps=3",
    )
    rec, seen = Record(), {}

    class Start(Callback):
        def on_train_start(self, trainer, pl_module):
            seen["scaler"] = trainer.precision_plugin.scaler and scaler_settings(
                trainer.precision_plugin.scaler
            )

    try:
        with caplog.at_level(logging.INFO):
            trainer, _, _ = fit(cfg, rec, Start())
    finally:  # FSDP's one-rank process group would outlive the test
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    plugin = trainer.precision_plugin
    assert type(trainer.strategy) is FSDPStrategy
    assert type(plugin) is FSDPPrecision and plugin.precision == mode
    assert rec.outputs == {DTYPES[mode][1]}
    assert len(rec.losses) == 3 and all(math.isfinite(v) for v in rec.losses), rec.losses
    if mode == "16-mixed":
        assert type(plugin.scaler) is ShardedGradScaler
        assert seen["scaler"] == {  # precision.scaler's, with torch's defaults
            "init_scale": 1024,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
        }
    else:
        assert plugin.scaler is None
    assert f"Precision: {mode}, layout channels_last, TF32 on" in caplog.text
