"""The sharding extra: FSDP and DeepSpeed keep the precision choice with its settings. Under
`precision=16-mixed` FSDP makes its own plugin with a sharded GradScaler of `precision.scaler`,
DeepSpeed its own loss scaler from it, and the Trainer is built with that plugin; trainer=fsdp
builds a sharding strategy. Lightning refuses FSDP without a GPU, so the plugins are checked on
the strategy objects here and trained on a GPU below (`pytest -m gpu`)."""

import logging
import math

import pytest
import torch
from hydra.utils import instantiate
from lightning import Callback
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from cifar_amp import build
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


def test_fsdp_makes_its_16_mixed_plugin_with_the_scaler_settings():
    made = FSDPStrategy().float16_plugin(SCALER, "cpu")
    assert type(made) is FSDPPrecision and made.precision == "16-mixed"
    assert type(made.scaler) is ShardedGradScaler and made.scaler.is_enabled()
    assert scaler_settings(made.scaler) == SCALER


def test_a_disabled_scaler_stays_disabled_under_fsdp():
    assert not FSDPStrategy().float16_plugin({"enabled": False}, "cpu").scaler.is_enabled()


def test_deepspeed_scales_the_loss_itself_with_the_scaler_settings():
    strategy = object.__new__(DeepSpeedStrategy)  # its constructor needs deepspeed installed
    plugin = strategy.float16_plugin({"growth_interval": 7}, "cuda")
    assert type(plugin) is DeepSpeedPrecision and plugin.precision == "16-mixed"
    assert (strategy.loss_scale, strategy.initial_scale_power, strategy.loss_scale_window) == (
        0.0,  # dynamic
        16,  # torch's init_scale 65536
        7,
    )
    assert deepspeed_loss_scaler({"enabled": False}) == {"loss_scale": 1.0}


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
        strategy.float16_plugin(setting, "cuda")


@pytest.mark.parametrize("mode", ["16-mixed", "bf16-mixed", "32-true"])
def test_the_trainer_is_built_with_the_plugin_the_extras_strategy_makes(mode):
    # FSDP asks for a GPU when the Trainer is built: here the arguments it would be built with.
    strategy = FSDPStrategy()
    args = Precision(mode, scaler=SCALER).trainer_args("cpu", strategy)
    if mode != "16-mixed":  # Lightning makes FSDPPrecision(mode) from the name
        assert args == {"precision": mode}
        return
    [plugin] = args["plugins"]
    assert type(plugin) is FSDPPrecision and scaler_settings(plugin.scaler) == SCALER
    strategy.precision_plugin = plugin  # as the Trainer's connector sets it: FSDP accepts it


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
        "module.optimizer.fused=false",
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


def test_fsdp_does_not_clip_by_norm(make_cfg):
    # Lightning's FSDP plugin cannot clip by norm, so trainer=fsdp turns the default's off.
    assert make_cfg("trainer=fsdp").trainer.gradient_clip_val is None


def test_a_fused_optimizer_clipped_under_a_sharded_16_mixed_is_refused(make_cfg):
    # The core's 16-mixed unscales a fused optimizer's gradients before clipping; FSDP's own
    # plugin does not, so the combination is refused before anything is built on a device.
    cfg = make_cfg(
        "trainer=fsdp",
        "precision=16-mixed",
        "module.optimizer.fused=true",
        "trainer.gradient_clip_val=1",
    )
    with pytest.raises(UserError, match="under precision=16-mixed with FSDPStrategy: Lightning"):
        build.trainer(cfg)


def test_fsdp_with_a_fused_optimizer_is_refused_before_a_device_is_touched(make_cfg):
    # On one H200 (torch 2.11) fused SGD failed FSDP's first step in both 16-bit modes.
    with pytest.raises(UserError, match="fused=true with FSDPStrategy: torch's fused optimizer"):
        build.trainer(make_cfg("trainer=fsdp", "precision=bf16-mixed"))
    cfg = make_cfg("trainer=fsdp", "precision=bf16-mixed", "module.optimizer.fused=false")
    build.check_fused_optimizer(cfg, build.precision(cfg), build.strategy(cfg.trainer.strategy))
