"""Each strategy gets the precision plugin of `precision=...` with its settings: FSDP its own
plugin and sharded GradScaler, DeepSpeed its own loss scaler; trainer=fsdp builds a sharding
strategy. Lightning refuses FSDP without a GPU, so the choice is checked by strategy type here
and trained in tests/test_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, MixedPrecision
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from cifar_amp.errors import UserError
from cifar_amp.precision import Precision, describe_plugin
from conftest import compose_cfg

SCALER = {"init_scale": 1024.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7}


def scaler_settings(sc) -> dict:
    return {
        "init_scale": sc.get_scale(),
        "growth_factor": sc.get_growth_factor(),
        "backoff_factor": sc.get_backoff_factor(),
        "growth_interval": sc.get_growth_interval(),
    }


@pytest.mark.parametrize(
    "strategy,plugin,scaler",
    [
        (SingleDeviceStrategy, MixedPrecision, torch.amp.GradScaler),
        (DDPStrategy, MixedPrecision, torch.amp.GradScaler),
        (FSDPStrategy, FSDPPrecision, ShardedGradScaler),
    ],
)
def test_16_mixed_gets_its_strategys_plugin_with_the_scaler_settings(strategy, plugin, scaler):
    made = Precision("16-mixed", scaler=SCALER).plugin(strategy, "cpu")
    assert type(made) is plugin and made.precision == "16-mixed"
    assert type(made.scaler) is scaler and made.scaler.is_enabled()
    assert scaler_settings(made.scaler) == SCALER


def test_a_disabled_scaler_stays_disabled_under_fsdp():
    made = Precision("16-mixed", scaler={"enabled": False}).plugin(FSDPStrategy, "cpu")
    assert not made.scaler.is_enabled()


def test_deepspeed_scales_the_loss_itself_with_the_scaler_settings():
    assert type(Precision("16-mixed").plugin(DeepSpeedStrategy, "cuda")) is DeepSpeedPrecision
    assert Precision("16-mixed").deepspeed_loss_scaler() == {
        "loss_scale": 0.0,
        "initial_scale_power": 16,  # torch's init_scale 65536
        "loss_scale_window": 2000,
    }
    off = Precision("16-mixed", scaler={"enabled": False})
    assert off.deepspeed_loss_scaler() == {"loss_scale": 1.0}


@pytest.mark.parametrize(
    "setting,message",
    [
        ({"init_scale": 1000.0}, "precision.scaler.init_scale: 1000.0; must be a power of 2"),
        ({"growth_factor": 3.0}, "precision.scaler.growth_factor: 3.0; must be 2"),
        ({"backoff_factor": 0.25}, "precision.scaler.backoff_factor: 0.25; must be 0.5"),
    ],
)
def test_scaler_settings_deepspeed_cannot_follow_are_refused(setting, message):
    with pytest.raises(UserError, match=message):
        Precision("16-mixed", scaler=setting).deepspeed_loss_scaler()


def test_the_fit_start_line_names_the_fsdp_plugin_and_its_scaler():
    plugin = Precision("16-mixed", scaler=SCALER).plugin(FSDPStrategy, "cpu")
    line = describe_plugin(SimpleNamespace(precision_plugin=plugin, precision="16-mixed"))
    assert line == (
        "16-mixed: float16 autocast on cuda (FSDPPrecision), ShardedGradScaler(init_scale=1024, "
        "growth_factor=4, backoff_factor=0.25, growth_interval=7)"
    )
    bf16 = FSDPPrecision("bf16-mixed")
    line = describe_plugin(SimpleNamespace(precision_plugin=bf16, precision="bf16-mixed"))
    assert line == "bf16-mixed: bfloat16 autocast on cuda (FSDPPrecision), no GradScaler"


def test_trainer_fsdp_shards_each_block_of_a_million_parameters():
    strategy = instantiate(compose_cfg("train", ["trainer=fsdp"]).trainer.strategy)
    assert isinstance(strategy, FSDPStrategy)
    policy = strategy.kwargs["auto_wrap_policy"]
    big, small = torch.nn.Linear(1000, 1000), torch.nn.Linear(10, 10)
    assert [policy(m, recurse=False, nonwrapped_numel=m.weight.numel()) for m in (big, small)] == [
        True,
        False,
    ]
