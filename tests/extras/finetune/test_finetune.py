"""init_from=<checkpoint>: a new run from another run's network weights (fine-tuning)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from cifar_amp import build, metrics
from cifar_amp.errors import UserError
from cifar_amp.extras.finetune import finetune
from cifar_amp.training import train
from cifar_folder import write_cifar_folder
from conftest import OWN, as_trained_by

HEAD = ("head.3.weight", "head.3.bias")  # SmallCNN's last Linear


@pytest.fixture
def make_cifar100_cfg(make_cfg, tmp_path):
    """make_cfg on a tiny CIFAR-100 folder: another dataset, with 100 classes."""
    folder = write_cifar_folder(tmp_path / "c100", "cifar100", per_file=200)  # one train file
    return lambda *o: make_cfg("data=cifar100", f"data.data_dir={folder}", *o)


@pytest.fixture
def cifar_ckpt(make_cfg, tmp_path):
    """last.ckpt of one epoch of SmallCNN on the tiny CIFAR-10 folder (10 classes)."""
    train(make_cfg(f"run_dir={tmp_path / 'cifar'}", "test=false"))
    return tmp_path / "cifar" / "checkpoints" / "last.ckpt"


def test_init_from_a_cifar10_checkpoint_into_100_classes(
    make_cifar100_cfg, cifar_ckpt, tmp_path, caplog
):
    saved = torch.load(cifar_ckpt, map_location="cpu", weights_only=True)["state_dict"]
    cfg = make_cifar100_cfg(f"init_from={cifar_ckpt}", f"run_dir={tmp_path / 'ft'}")
    dm = build.datamodule(cfg)
    module = build.module(cfg, dm.num_classes)
    fresh = {k: v.clone() for k, v in module.net.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="cifar_amp.extras.finetune.finetune"):
        finetune.FineTune(cfg.init_from).before_run(None, module)
    for key, value in module.net.state_dict().items():
        if key in HEAD:  # re-initialised: as built, sized for 100 classes
            assert value.shape[0] == 100 and torch.equal(value, fresh[key])
        else:
            assert torch.equal(value, saved[f"net.{key}"]), key
    log = caplog.text
    assert "loaded 6 of the network's 8 tensors" in log
    assert "re-initialised the classification head for 100 classes (the checkpoint's has 10)" in log
    assert "head.3.weight, head.3.bias" in log

    # The run itself: another dataset and class count, from epoch 0 with a fresh optimizer.
    result = train(cfg)
    assert result[metrics.EPOCHS] == 1
    last = torch.load(tmp_path / "ft" / "checkpoints" / "last.ckpt", weights_only=True)
    # One epoch of 180 images in 16s: step and schedule start at 0, not where CIFAR-10's ended.
    assert last["global_step"] == last["lr_schedulers"][0]["last_epoch"] == 11
    assert last["hyper_parameters"]["num_classes"] == 100


def test_same_class_count_loads_the_head_too(make_cfg, cifar_ckpt, tmp_path):
    cfg = make_cfg(f"init_from={cifar_ckpt}", f"run_dir={tmp_path / 'again'}")
    module = build.module(cfg, 10)
    finetune.FineTune(cfg.init_from).before_run(None, module)
    saved = torch.load(cifar_ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert torch.equal(module.net.state_dict()["head.3.weight"], saved["net.head.3.weight"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("ckpt_path={ckpt}",), "init_from=.* and ckpt_path=.* exclude each other"),
        (("model=speednet",), r"does not fit this model \(the checkpoint's network: "),
        (("model.width=16",), r"shapes \(checkpoint vs model\): blocks.0.0.weight"),
    ],
)
def test_refused_in_one_line(make_cifar100_cfg, cifar_ckpt, tmp_path, overrides, expected):
    extra = [o.format(ckpt=cifar_ckpt) for o in overrides]
    cfg = make_cifar100_cfg(f"init_from={cifar_ckpt}", f"run_dir={tmp_path / 'x'}", *extra)
    with pytest.raises(UserError, match=expected) as e:
        train(cfg)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()  # refused before the run dir is made


def test_missing_or_foreign_file_is_refused(make_cifar100_cfg, tmp_path):
    foreign = tmp_path / "weights.pt"
    torch.save({"conv.weight": torch.zeros(1)}, foreign)
    for path, expected in ((tmp_path / "nope.ckpt", "no such file"), (foreign, "no 'state_dict'")):
        with pytest.raises(UserError, match=f"init_from={path}.*{expected}"):
            train(make_cifar100_cfg(f"init_from={path}", f"run_dir={tmp_path / 'x'}"))


def test_init_from_reads_its_checkpoint_as_data_once(make_cfg, tmp_path, evil_ckpt, monkeypatch):
    from test_checkpoints import project_loads

    path, marker = evil_ckpt
    with pytest.raises(UserError, match=f"init_from={path} holds .*trust_checkpoint=true"):
        train(make_cfg(f"init_from={path}", f"run_dir={tmp_path / 'x'}"))
    assert not marker.exists() and not (tmp_path / "x").exists()
    good = tmp_path.parent / "good.ckpt"
    torch.save(torch.load(path, weights_only=False) | {"note": None}, good)
    loads = project_loads(monkeypatch)
    train(make_cfg(f"init_from={good}", f"run_dir={tmp_path / 'y'}"))
    assert loads == [str(good)]


def test_init_from_a_forks_own_module_checks_its_class_and_takes_its_weights(
    make_cfg, marked_run, tmp_path
):
    last = marked_run / "checkpoints" / "last.ckpt"
    cfg = make_cfg(f"init_from={last}")
    module = build.module(cfg, 10)
    finetune.FineTune(cfg.init_from).before_run(None, module)
    saved = torch.load(last, weights_only=True)["state_dict"]
    assert all(torch.equal(v, saved[f"net.{k}"]) for k, v in module.net.state_dict().items())
    ckpt = torch.load(last, weights_only=True)
    ckpt["run_settings"]["module._target_"] = "gone_package.Module"
    torch.save(ckpt, tmp_path / "gone.ckpt")
    with pytest.raises(UserError, match="trained by the module gone_package.Module, which does"):
        finetune.FineTune(str(tmp_path / "gone.ckpt"))


def test_init_from_imports_no_module_that_a_run_may_not_use(tmp_path, monkeypatch):
    from test_checkpoint_names import crafted

    monkeypatch.delitem(sys.modules, "this", raising=False)  # it prints the Zen of Python
    path = crafted(tmp_path, settings={"module._target_": "this.Anything"})
    with pytest.raises(UserError, match=f"init_from={path} names this.Anything at module._targ"):
        finetune.FineTune(str(path))
    assert "this" not in sys.modules


def test_init_from_a_lightning_module_of_its_own_and_into_one(make_cfg, own_run, marked_run):
    """tests/examples/own_module.py keeps its network as `net`: init_from takes its weights,
    into the template's module, and gives it another's."""
    own, marked = (run / "checkpoints" / "last.ckpt" for run in (own_run, marked_run))
    template, ours = build.module(make_cfg(), 10), build.module(make_cfg(*OWN), 10)
    assert type(ours).__name__ == "OwnClassifier"
    for source, module in ((own, template), (marked, ours)):
        finetune.FineTune(str(source)).before_run(None, module)
        saved = torch.load(source, weights_only=True)["state_dict"]
        assert all(torch.equal(v, saved[f"net.{k}"]) for k, v in module.net.state_dict().items())


def test_init_from_a_module_without_net_is_one_line(own_run, tmp_path):
    last = own_run / "checkpoints" / "last.ckpt"
    with pytest.raises(
        UserError, match="init_from needs the module's network as its attribute `net`"
    ):
        finetune.FineTune(str(last)).before_run(None, BoringModel())
    path = "lightning.pytorch.demos.boring_classes.BoringModel"
    ckpt = as_trained_by(last, tmp_path / "m.ckpt", path, BoringModel().state_dict())
    with pytest.raises(UserError, match="its module, BoringModel, keeps no network as `net`"):
        finetune.FineTune(str(ckpt))
