"""The commands themselves, as a user runs them (subprocess only for what needs the CLI)."""

import importlib.metadata
import json
import os
import subprocess
import sys
import urllib.request

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import open_dict

from cifar_amp import cli, config, errors
from cifar_amp.data.cifar import CIFARDataModule
from cifar_amp.errors import UserError
from conftest import CONFIGS, REPO, SHRINK, command, compose_cfg


def run(*args, tmp_path, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_no_data_and_no_network_gives_one_clear_message(tmp_path, monkeypatch):
    # a proxy that refuses connections stands in for "offline", so this never downloads
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setattr(urllib.request, "_opener", None)  # an opener made earlier kept its proxies
    with pytest.raises(UserError) as e:
        CIFARDataModule(data_dir=str(tmp_path / "empty")).prepare_data()
    err = str(e.value)  # the command prints it as one line, exit 2 (test_bad_input.py)
    assert "\n" not in err and "data.data_dir" in err
    assert "download failed" in err and "connect to the internet" in err


def refusal(capsys, argv: list[str], entry: str = "train") -> str:
    """What the command prints before Hydra starts (cli.check_overrides), in this process: a
    subprocess costs an import of torch and Lightning (about 11 s on the 2-core box)."""
    config.register(CONFIGS)
    with pytest.raises(SystemExit) as e:
        cli.check_overrides(argv, CONFIGS, entry)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "override,expected",
    [
        ("precision=fp8", ["precision", "16-mixed", "bf16-mixed", "32-true"]),
        ("model=vgg", ["model", "speednet", "small_cnn"]),
        ("trainer=tpu", ["trainer", "ddp_cpu", "gpu"]),
        ("precision=32-true,fp16", ["precision=fp16", "bf16-true"]),  # a sweep, item by item
        # Hydra's ValueError ("Config group override must be a string or a list") with a traceback
        ("module/scheduler=null", ["a config group takes one of its options", "cosine, none"]),
    ],
)
def test_unknown_option_exits_2_and_lists_choices(capsys, override, expected):
    err = refusal(capsys, [override])
    for word in expected:
        assert word in err


TYPOS = [
    (
        "trainer.max_epoch=3",
        "trainer.max_epoch is not a config key; did you mean trainer.max_epochs?",
    ),
    (
        "data.augment.fliip=true",
        "valid keys of data.augment: alternate_flip, cutmix_alpha, cutout, flip, mixup_alpha, translate",
    ),
    (
        "trainer.max_epochs=abc",
        "trainer.max_epochs=abc: Value 'abc' of type 'str' could not be converted",
    ),
]


@pytest.mark.parametrize("override,expected", TYPOS)
def test_typo_or_wrong_type_gets_one_line_with_what_is_valid(capsys, override, expected):
    assert expected in refusal(capsys, [override])


@pytest.mark.parametrize(
    "sweep,expected",
    [("trainer.max_epoch=1,2", TYPOS[0][1]), ("trainer.max_epochs=1,abc", TYPOS[2][1])],
)
def test_a_sweep_gets_the_same_one_line_message_as_a_single_run(capsys, sweep, expected):
    assert expected in refusal(capsys, ["-m", sweep])


@pytest.mark.slow  # the command itself; in this process: every `refusal` test
def test_the_commands_refusal_is_one_line_exit_2_before_anything_runs(tmp_path):
    # A sweep, whose second job is refused: nothing runs, not even the first.
    args = ["-m", "trainer.max_epochs=1,abc", f"hydra.sweep.dir={tmp_path}/sweep"]
    r = run("train.py", *args, f"hydra.run.dir={tmp_path}/run", tmp_path=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and TYPOS[2][1] in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())  # refused before any run or sweep dir


def test_bad_value_exits_2_with_one_line_naming_the_key(tmp_path, monkeypatch, capsys):
    # The command as a whole (the override check, Hydra, the job runner, the run built) up to a
    # range the constructor checks (test_bad_input: each such message); in this process.
    args = ("data.batch_size=0", f"hydra.run.dir={tmp_path}")
    code, err = command(monkeypatch, capsys, "train.py", *args)
    assert code == 2 and "Traceback" not in err
    assert err.strip() == "error: invalid config value for data.batch_size: 0; must be >= 1"


@pytest.mark.slow  # the command itself; in this process: the next test
def test_a_training_override_given_to_eval_gets_one_line_and_exit_2(tmp_path):
    # Hydra said "Could not override 'model'" over several lines, advising +model=... (which it
    # then took and ignored), and exited 1.
    r = run("eval.py", "ckpt_path=x.ckpt", "model=small_cnn", tmp_path=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith(
        "error: model=small_cnn: eval.py takes the network from the checkpoint (ckpt_path)"
    )


@pytest.mark.parametrize(
    "override,expected",
    [
        ("+model=small_cnn", "+model=small_cnn: eval.py takes the network from the checkpoint"),
        ("module.optimizer.lr=0.1", "eval.py takes the module's settings"),
        ("module/optimizer=adamw", "module/optimizer=adamw: eval.py takes the module's settings"),
        ("experiment=cpu_quick", "experiment=cpu_quick: eval.py takes no experiment (a train"),
        ("test=false", "test=false: eval.py takes no test"),
    ],
)
def test_eval_names_what_it_takes_from_the_checkpoint(capsys, override, expected):
    err = refusal(capsys, ["ckpt_path=x.ckpt", override], "eval")
    assert expected in err
    assert "its keys: callbacks, ckpt_path, data, logger, precision, run_dir, seed, trainer" in err


def test_a_recipe_that_sets_keys_another_model_lacks_is_named(capsys):
    # Hydra's several lines ("In 'experiment/cpu_quick': ConfigKeyError ..."), exit 1.
    err = refusal(capsys, ["model=small_cnn", "experiment=cpu_quick"])
    assert err.startswith(
        "error: experiment=cpu_quick sets model.widths, which model=small_cnn does not take; "
        "its keys: _target_, activation_checkpointing, checkpoint_stages, hidden"
    )


def test_a_value_holding_an_equals_sign_gets_one_line_saying_how_to_quote_it(capsys):
    # Hydra: "mismatched input '=' expecting <EOF>", a traceback and exit 1.
    path = "/runs/r/checkpoints/epoch=0-step=7.ckpt"  # a name Lightning's callbacks may write
    err = refusal(capsys, [f"ckpt_path={path}"], "eval")
    quoted = err.rstrip().rpartition(": ")[2].strip('"')  # as the shell passes it on
    assert quoted == f"ckpt_path='{path}'"
    assert OverridesParser.create().parse_overrides([quoted])[0].value() == path


def test_eval_keys_pass(capsys):
    config.register(CONFIGS)
    cli.check_overrides(["ckpt_path=x.ckpt", "data.batch_size=64", "trainer=cpu"], CONFIGS, "eval")
    assert capsys.readouterr().err == ""


def test_a_sweeps_job_is_the_cores_where_no_hydra_callback_runs_jobs(capsys):
    # As without the multirun extra: a refusal is one line and exit 2, which ends the sweep.
    cfg = compose_cfg("train", return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.callbacks = {}
        cfg.hydra.mode = RunMode.MULTIRUN
    HydraConfig.instance().set_config(cfg)

    def task(cfg):
        raise UserError("seed=3: refused")

    try:
        with pytest.raises(SystemExit) as e:
            cli.job(task)(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert e.value.code == 2 and capsys.readouterr().err == "error: seed=3: refused\n"


@pytest.mark.slow
def test_two_job_multirun_gives_each_job_its_own_run(tmp_path, tiny_data):
    r = run(
        "train.py",
        "-m",
        "precision=32-true,bf16-mixed",
        *SHRINK,
        f"data.data_dir={tiny_data}",
        f"hydra.sweep.dir={tmp_path}/sweep",
        tmp_path=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    jobs = sorted((tmp_path / "sweep").glob("*/metrics.json"))
    assert [p.parent.name for p in jobs] == ["0", "1"]
    assert [json.loads(p.read_text())["precision"] for p in jobs] == ["32-true", "bf16-mixed"]
    assert all((p.parent / "checkpoints" / "last.ckpt").is_file() for p in jobs)


@pytest.mark.slow
def test_train_then_eval_from_the_command_line(tmp_path, tiny_data):
    data = f"data.data_dir={tiny_data}"
    r = run(
        "train.py",
        *SHRINK,
        data,
        "trainer.max_epochs=2",
        f"hydra.run.dir={tmp_path}/t",
        tmp_path=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    trained = json.loads((tmp_path / "t" / "metrics.json").read_text())
    r = run(
        "eval.py",
        data,
        "trainer=cpu",
        f"ckpt_path={trained['tested_ckpt']}",
        f"hydra.run.dir={tmp_path}/e",
        tmp_path=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        json.loads((tmp_path / "e" / "metrics.json").read_text())["test/acc"] == trained["test/acc"]
    )


def plugin_configs(tmp_path, launcher: str):
    """An app whose hydra/launcher=cluster is `launcher` (a YAML body)."""
    (tmp_path / "hydra" / "launcher").mkdir(parents=True)
    (tmp_path / "train.yaml").write_text("x: 1\n")
    (tmp_path / "hydra" / "launcher" / "cluster.yaml").write_text(launcher)
    return tmp_path


def test_an_option_on_a_hydra_plugin_that_is_not_installed_is_one_line(
    tmp_path, capsys, monkeypatch
):
    # As hydra/launcher=slurm builds on submitit_slurm: Hydra says "Could not load
    # 'hydra/launcher/submitit_slurm'" with its search path, 8 lines, exit 1.
    configs = plugin_configs(tmp_path, "defaults:\n  - cluster_plugin\n")
    monkeypatch.setattr(
        cli, "pip_commands", lambda: {"hydra-cluster": "pip install -e '.[cluster]'"}
    )
    with pytest.raises(SystemExit) as e:
        cli.check_overrides(["-m", "hydra/launcher=cluster", "x=2,3"], configs, "train")
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: hydra/launcher=cluster needs hydra/launcher/cluster_plugin, a config of a Hydra "
        "plugin: hydra-cluster, which is not installed here: pip install -e '.[cluster]'\n"
    )


def test_a_sweeps_launcher_whose_package_is_not_installed_is_one_line(
    tmp_path, capsys, monkeypatch
):
    # Hydra: "Unknown plugin class" in a traceback when the sweep starts.
    configs = plugin_configs(tmp_path, "_target_: cluster_launcher.launcher.Launcher\n")
    monkeypatch.setattr(
        errors, "pip_commands", lambda: {"cluster-launcher": "pip install -e '.[c]'"}
    )
    cli.check_overrides(["hydra/launcher=cluster", "x=2"], configs, "train")  # one run: no launcher
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as e:
        cli.check_overrides(["-m", "hydra/launcher=cluster", "x=2,3"], configs, "train")
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: hydra/launcher=cluster needs cluster-launcher, which is not installed here: "
        "pip install -e '.[c]'\n"
    )


def test_run_from_a_checkout_without_installing_it_the_pip_hints_come_from_pyproject(monkeypatch):
    # PYTHONPATH=src: no distribution's metadata to read the hints from, so a missing package
    # of an option was a traceback.
    errors.pip_commands.cache_clear()
    installed = errors.pip_commands()
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {})
    errors.pip_commands.cache_clear()
    try:
        checkout = errors.pip_commands()
        assert errors.missing_package(ImportError(name="mlflow")) == (
            "mlflow, which is not installed here: pip install -e '.[trackers]'"
        )
    finally:
        errors.pip_commands.cache_clear()
    assert checkout.keys() == installed.keys() and "cifar-amp" not in checkout
    extras = {k: v for k, v in installed.items() if " -e " in v}  # a group's: no version to order
    assert extras == {k: v for k, v in checkout.items() if " -e " in v} and extras
