"""A class name read from a checkpoint is data: it imports only this package, the packages the
configs name (checkpoints.PACKAGES) and your own code; any other module, the standard library's
too, is refused in one line before it is imported (importing runs its code)."""

from __future__ import annotations

import sys

import pytest
import torch

from cifar_amp import checkpoints
from cifar_amp.checkpoints import SETTINGS
from cifar_amp.errors import UserError
from cifar_amp.evaluation import evaluate
from conftest import ASSETS, command

RELEASE = ASSETS / "release-cd84677-last.ckpt"  # small_cnn; no metrics in its hparams


def crafted(tmp_path, settings: dict | None = None, hparams: dict | None = None):
    """A copy of a real checkpoint with some of its recorded settings and hparams replaced."""
    ckpt = torch.load(RELEASE, map_location="cpu", weights_only=True)
    ckpt[SETTINGS] |= settings or {}
    ckpt["hyper_parameters"] |= hparams or {}
    torch.save(ckpt, tmp_path / "crafted.ckpt")
    return tmp_path / "crafted.ckpt"


def test_eval_refuses_a_module_of_the_standard_library_before_importing_it(
    monkeypatch, capsys, tmp_path, tiny_data
):
    # `import this` prints the Zen of Python: it must not be imported, so not printed.
    monkeypatch.delitem(sys.modules, "this", raising=False)
    path = crafted(tmp_path, settings={"module._target_": "this.Anything"})
    run = tmp_path / "run"
    args = ("trainer=cpu", "logger=none", f"data.data_dir={tiny_data}", f"hydra.run.dir={run}")
    code, err = command(monkeypatch, capsys, "eval.py", f"ckpt_path={path}", *args)
    assert code == 2 and "this" not in sys.modules
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: ckpt_path={path} names this.Anything at module._target_: ")
    assert "the module this is not imported" in line
    assert line.endswith("If you trust the file: trust_checkpoint=true")
    assert not (run / "config.yaml").exists() and not (run / "metrics.json").exists()


@pytest.mark.parametrize(
    "hparams, key",
    [
        ({"net": {"_target_": "antigravity.Net", "width": 8}}, "module.net._target_"),
        (  # nested: Hydra's instantiate would import it before the network's class is called
            {"net": {"_target_": "torch.nn.Identity", "width": {"_target_": "antigravity.f"}}},
            "module.net.width._target_",
        ),
        ({"metrics": {"acc": {"_target_": "antigravity.Metric"}}}, "module.metrics.acc._target_"),
        ({"optimizer": {"_target_": "antigravity.Opt", "lr": 0.1}}, "module.optimizer._target_"),
    ],
)
def test_the_modules_arguments_name_no_module_outside_the_allowed(
    make_cfg, monkeypatch, tmp_path, hparams, key
):
    monkeypatch.delitem(sys.modules, "antigravity", raising=False)  # it opens a web browser
    path = crafted(tmp_path, hparams=hparams)
    with pytest.raises(UserError, match=f"names antigravity.* at {key}: the module antigravity "):
        evaluate(make_cfg(f"ckpt_path={path}", config_name="eval"))
    assert "antigravity" not in sys.modules


def test_an_installed_package_that_no_config_names_is_refused_unless_the_file_is_trusted(
    make_cfg, tmp_path
):
    path = crafted(tmp_path, settings={"module._target_": "yaml.YAMLObject"})
    with pytest.raises(UserError, match="the module yaml is not imported"):
        evaluate(make_cfg(f"ckpt_path={path}", config_name="eval"))
    # Trusted, the file could run any code when unpickled: its names are looked up as they are.
    with pytest.raises(UserError, match="names yaml.YAMLObject as its module, which is not a Li"):
        evaluate(make_cfg(f"ckpt_path={path}", "trust_checkpoint=true", config_name="eval"))


@pytest.mark.parametrize(
    "path",
    ["this.Anything", "os.system", "builtins.print", "__main__.Module", ".relative", "yaml.Loader"],
)
def test_a_name_outside_the_allowed_is_refused(path):
    assert not checkpoints.may_import(path)


def test_the_packages_a_config_names_and_this_one_are_allowed():
    own = checkpoints.__name__.split(".")[0]  # cifar_amp, or a fork's name after make rename
    assert checkpoints.may_import(f"{own}.module.ImageClassifier")
    assert checkpoints.may_import("torchmetrics.classification.MulticlassAccuracy")
    assert checkpoints.may_import("torch.optim.SGD")


def test_your_code_on_the_path_is_allowed_without_being_imported(monkeypatch, tmp_path):
    (tmp_path / "forks_module.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "forks_package").mkdir()
    (tmp_path / "forks_package" / "__init__.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert checkpoints.may_import("forks_module.Module")
    assert checkpoints.may_import("forks_package.sub.Module")
    assert "forks_module" not in sys.modules and "forks_package" not in sys.modules
    # A name found nowhere runs nothing; its lookup then says that it does not import.
    assert checkpoints.may_import("no_such_package_here.Module")
