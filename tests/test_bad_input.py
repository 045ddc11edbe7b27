"""Bad input stops before training with a one-line message naming the key or file."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy

import compat
from cifar_amp import build, errors, runs
from cifar_amp.errors import UserError
from cifar_amp.module import ImageClassifier
from cifar_amp.precision import Precision
from cifar_amp.training import train
from conftest import SHRINK, command, compose_cfg

SMALL = {"_target_": "cifar_amp.models.small_cnn.SmallCNN", "width": 8, "hidden": 32}

CONFIG_CASES = [
    # (overrides, message fragment)
    (["module.optimizer.lr=-0.1"], "module.optimizer.lr: -0.1; must be > 0"),
    (["data.batch_size=0"], "data.batch_size: 0; must be >= 1"),
    (["data.val_split=1.5"], "data.val_split: 1.5; must be in [0, 1)"),
    (["module.compile_mode=fast"], "module.compile_mode: 'fast'; valid: default, reduce-overhead"),
]


@pytest.mark.parametrize("overrides, message", CONFIG_CASES)
def test_bad_config_value(make_cfg, overrides, message):
    with pytest.raises(UserError, match=None) as e:
        train(make_cfg(*overrides))
    assert message in str(e.value)


COMPOSE_CASES = [
    ("trainer.max_epoch=3", "Could not override 'trainer.max_epoch'"),  # typo
    ("trainer.max_epochs=abc", "Error merging override trainer.max_epochs=abc"),  # wrong type
    ("model=foo", "Could not find 'model/foo'"),  # unknown option of a group
    ("precision=fp8", "Could not find 'precision/fp8'"),
]


@pytest.mark.parametrize("override, message", COMPOSE_CASES)
def test_bad_config_fails_at_composition(override, message):
    with pytest.raises(Exception) as e:
        compose_cfg("train", [override])
    assert message in str(e.value)


def test_16_mixed_with_lightnings_fsdp_is_refused_by_lightning():
    # FSDP takes only its own plugins, made from the Trainer's precision name, which would drop
    # precision.scaler; the sharding extra's strategies make theirs from it (tests/extras/sharding/).
    # Lightning refuses ours when the Trainer's connector gives it to the strategy. (DeepSpeed
    # takes any: the guards extra refuses it, tests/extras/guards/.)
    with pytest.raises(TypeError, match="FSDP strategy can only work with the `FSDPPrecision`"):
        FSDPStrategy().precision_plugin = Precision("16-mixed").plugin("cpu")


def _break_data(folder, how):
    batches = folder / "cifar-10-batches-py"
    if how == "missing folder":
        shutil.rmtree(batches)
    elif how == "missing file":
        (batches / "data_batch_3").unlink()
    elif how == "truncated file":
        raw = (batches / "data_batch_2").read_bytes()
        (batches / "data_batch_2").write_bytes(raw[: len(raw) // 2])
    else:
        entry = pickle.loads((batches / "data_batch_1").read_bytes())
        if how == "wrong shape":
            entry["data"] = entry["data"][:, :100]
        else:  # labels out of range
            entry["labels"] = [10] * len(entry["labels"])
        (batches / "data_batch_1").write_bytes(pickle.dumps(entry))


DATA_CASES = [
    ("missing folder", "no cifar-10-batches-py/ found in data.data_dir="),
    ("missing file", "missing data file"),
    ("truncated file", "data_batch_2 is truncated or not a CIFAR python batch file"),
    ("wrong shape", "data_batch_1: data has shape (40, 100), expected (N, 3072)"),
    ("labels out of range", "data_batch_1: labels span [10, 10], expected [0, 9]"),
]


@pytest.mark.parametrize("how, message", DATA_CASES)
def test_bad_data_folder(make_cfg, tiny_data, tmp_path, how, message):
    folder = shutil.copytree(tiny_data, tmp_path / "data")
    _break_data(folder, how)
    with pytest.raises(UserError) as e:
        train(make_cfg(f"data.data_dir={folder}"))
    assert message in str(e.value)


def _fake_ckpt(path, num_classes=10, net=None, **args):
    module = ImageClassifier(net=net or {**SMALL, **args}, num_classes=num_classes)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


def _truncated(path):
    raw = _fake_ckpt(path).read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return path


CKPT_CASES = [
    (lambda p: p / "nope.ckpt", "nope.ckpt: no such file"),
    (_truncated, "is truncated or not a checkpoint"),
    (
        lambda p: _fake_ckpt(p, width=4),
        "does not fit this model (check model=... and module.metrics): shapes (checkpoint vs model): net.blocks.0.0.weight (4, 3, 3, 3) vs (8, 3, 3, 3)",
    ),
    (lambda p: _fake_ckpt(p, num_classes=100), "was trained for 100 classes; data.dataset has 10"),
    (
        lambda p: _fake_ckpt(p, net={"_target_": "cifar_amp.models.speednet.SpeedNet"}),
        "missing from the checkpoint: net.blocks.0.0.bias",
    ),
]


@pytest.mark.parametrize("make, message", CKPT_CASES)
def test_bad_checkpoint(make_cfg, tmp_path, make, message):
    path = make(tmp_path / "x.ckpt")
    with pytest.raises(UserError) as e:
        train(make_cfg(f"ckpt_path={path}"))
    assert message in str(e.value)


def test_used_run_dir_is_refused_unless_resuming(tmp_path):
    with runs.claim(str(tmp_path), resuming=False):  # empty: fine
        (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(
        UserError, match=f"run dir {tmp_path} already holds a run; resume it with ckpt_path="
    ):
        with runs.claim(str(tmp_path), resuming=False):
            pass
    with runs.claim(str(tmp_path), resuming=True):
        pass


def _cli(monkeypatch, capsys, tmp_path, *overrides) -> tuple[int, str]:
    """train.py with `overrides`, in this process (conftest.command): exit status, stderr."""
    args = [*SHRINK, f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    return command(monkeypatch, capsys, "train.py", *args, cwd=tmp_path)


@pytest.mark.slow  # each, the whole command up to its refusal: about a second
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.max_epochs=abc"], "trainer.max_epochs"),
        (
            ["module.optimizer.lr=-1"],  # a float in the schema (torch's float | Tensor)
            "error: invalid config value for module.optimizer.lr: -1.0; must be > 0",
        ),
        (["ckpt_path=/no/such.ckpt"], "error: ckpt_path=/no/such.ckpt: no such file"),
        (
            ["data.data_dir=/no/such/folder"],
            "error: no cifar-10-batches-py/ found in data.data_dir=/no/such/folder",
        ),
    ],
)
def test_cli_reports_bad_input_without_traceback(
    monkeypatch, capsys, tmp_path, tiny_data, overrides, message
):
    code, err = _cli(monkeypatch, capsys, tmp_path, f"data.data_dir={tiny_data}", *overrides)
    assert code != 0
    assert "Traceback" not in err
    assert message in err
    if message.startswith("error: "):  # ours: the message is one line
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert line.startswith(message)


@pytest.mark.slow
def test_cli_full_traceback_on_request(monkeypatch, capsys, tmp_path, tiny_data):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    bad = ("module.optimizer.lr=-1", f"data.data_dir={tiny_data}")
    code, err = _cli(monkeypatch, capsys, tmp_path, *bad)
    assert code != 0 and "Traceback" in err


# How pyproject.toml's lines read in the installed project's metadata (errors.pip_commands).
REQUIRES = [
    "rich>=13",
    'optuna<6,>=4; extra == "sweeps"',
    'hydra-submitit-launcher<1.3,>=1.2; extra == "sweeps"',
    'wandb<1,>=0.19; extra == "trackers"',
]


SWEEPS, TRACKERS = "pip install -e '.[sweeps]'", "pip install -e '.[trackers]'"


@pytest.mark.parametrize(
    "error,expected",
    [
        (ModuleNotFoundError("No module named 'optuna'", name="optuna"), f"optuna, {SWEEPS}"),
        (
            ModuleNotFoundError("x", name="hydra_plugins.hydra_submitit_launcher"),
            f"hydra-submitit-launcher, {SWEEPS}",
        ),
        # Lightning's requirement checks name the package in the message only
        (
            ModuleNotFoundError("Requirement 'wandb>=0.12.10' not met. HINT: ..."),
            f"wandb, {TRACKERS}",
        ),
        (
            ModuleNotFoundError("`RichProgressBar` requires `rich` >= 10.2.2."),
            "rich, pip install 'rich>=13'",
        ),
        (ModuleNotFoundError("No module named 'my_code'", name="my_code"), None),  # not ours
        (ValueError("optuna"), None),
    ],
)
def test_a_missing_package_is_named_with_the_pip_command_of_its_extra(monkeypatch, error, expected):
    monkeypatch.setattr(errors.importlib.metadata, "requires", lambda name: REQUIRES)
    errors.pip_commands.cache_clear()
    try:
        found = errors.missing_package(error)
    finally:
        errors.pip_commands.cache_clear()
    if expected is not None:
        name, how = expected.split(", ")
        expected = f"{name}, which is not installed here: {how}"
    assert found == expected


def test_a_callback_whose_package_is_missing_is_one_line_naming_it(make_cfg, monkeypatch):
    """Lightning's RichProgressBar without rich: the config key, the package, its pip line."""
    compat.without_rich(monkeypatch)
    with pytest.raises(UserError) as e:
        build.callbacks(make_cfg("callbacks=[default,rich]"))
    msg = str(e.value)
    assert msg.startswith("callbacks.progress_bar needs rich, which is not installed here: ")
    assert msg.endswith(errors.pip_commands()["rich"]) and "\n" not in msg
