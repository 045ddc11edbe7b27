"""model=timm: any timm network, sized for the data's classes; pretrained weights offline."""

from __future__ import annotations

import sys

import huggingface_hub.constants  # a module of its own: 2.x no longer makes it an attribute on import
import pytest
import torch
from safetensors.torch import save_file

from cifar_amp import build, metrics
from cifar_amp.errors import InvalidArgument, UserError
from cifar_amp.evaluation import evaluate
from cifar_amp.extras.finetune.timm_net import Timm
from cifar_amp.module import ImageClassifier
from cifar_amp.training import train

NAME = "test_resnet"  # timm's own tiny ResNet for tests (0.4M parameters)
SHORT = (
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
)


@pytest.mark.slow  # a model's end-to-end run (its fast_dev_run: the default tier)
def test_a_timm_network_trains_and_rebuilds_from_its_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg("model=timm", f"model.name={NAME}", "model.activation_checkpointing=1", *SHORT)
    result = train(cfg)
    assert 0.0 <= result[metrics.TEST_ACC] <= 1.0
    module = ImageClassifier.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert type(module.net).__name__ == "ResNet" and module.net.grad_checkpointing
    assert module(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_pretrained_without_network_says_how_to_use_a_local_file(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network
    with pytest.raises(UserError) as e:
        Timm(NAME, num_classes=3, pretrained=True)
    msg = str(e.value)
    assert msg.startswith(f"model.pretrained=true: cannot fetch {NAME}'s weights")
    assert "model.pretrained_path=<file>" in msg and "\n" not in msg


@pytest.mark.slow  # a model's end-to-end run
def test_pretrained_path_loads_a_local_file_and_checkpoints_need_it_no_more(make_cfg, tmp_path):
    import timm  # here: importing it (and wandb, which it imports) costs each xdist worker ~1.4 s

    source = timm.create_model(NAME)  # 1000 classes, as ImageNet weights are
    weights = tmp_path / "weights.safetensors"
    save_file(source.state_dict(), weights)
    net = Timm(NAME, num_classes=3, pretrained_path=str(weights))
    assert torch.equal(net.conv1[0].weight, source.conv1[0].weight)
    assert net.fc.weight.shape == (3, source.fc.weight.shape[1])  # head re-sized for 3 classes

    cfg = make_cfg("model=timm", f"model.name={NAME}", f"model.pretrained_path={weights}", *SHORT)
    train(cfg)
    weights.unlink()  # evaluation rebuilds the network from the checkpoint alone
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert (
        torch.load(ckpt, weights_only=False)["hyper_parameters"]["net"]["pretrained_path"] is None
    )
    eval_cfg = make_cfg(f"ckpt_path={ckpt}", f"run_dir={tmp_path / 'eval'}", config_name="eval")
    assert 0.0 <= evaluate(eval_cfg)[metrics.TEST_ACC] <= 1.0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"name": "test_resnt"}, "did you mean test_resnet"),
        ({"name": NAME, "pretrained_path": "/nowhere.pth"}, "no such file"),
        ({"name": NAME, "activation_checkpointing": -1}, "must be >= 0"),
        ({"name": NAME, "kwargs": {"no_such_arg": 1}}, "no_such_arg"),
    ],
)
def test_bad_arguments_name_the_key(kwargs, expected):
    with pytest.raises(InvalidArgument, match=expected):
        Timm(num_classes=3, **kwargs)


def test_bad_name_through_the_builder(make_cfg):
    cfg = make_cfg("model=timm", "model.name=resnet_nope")
    with pytest.raises(UserError, match=r"^invalid config value for model\.name: 'resnet_nope'"):
        build.module(cfg, 10)


def test_model_timm_without_timm_is_one_line_naming_its_pip_command(make_cfg, monkeypatch):
    for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
        monkeypatch.setitem(sys.modules, name, None)
    cfg = make_cfg("model=timm", "model.name=resnet18")
    with pytest.raises(UserError) as e:
        build.module(cfg, num_classes=10)
    msg = str(e.value)
    assert msg.startswith("model needs timm, which is not installed here: pip install ")
    assert "timm" in msg.rpartition("pip install")[2] and "\n" not in msg
