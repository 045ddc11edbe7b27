"""Checkpoints are read as data, once per command: a file that would run code is refused
before any of it runs, and every earlier release's checkpoints still load."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cifar_amp import build, checkpoints, metrics
from cifar_amp.errors import UserError
from cifar_amp.evaluation import evaluate
from cifar_amp.training import train
from conftest import ASSETS, REPO, SHRINK

# Written by earlier releases (small_cnn on the tiny folder, 16-mixed): the layout before the
# settings moved into the constructors (872b18b), and the release cd84677 (2 epochs).
RELEASES = ["legacy-last.ckpt", "release-cd84677-last.ckpt"]


def project_loads(monkeypatch) -> list[str]:
    """The torch.load calls the template's own code makes (Lightning's inside fit/test aside)."""
    calls, real = [], torch.load

    def counted(path, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("cifar_amp"):
            calls.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    return calls


@pytest.mark.parametrize("name", RELEASES)
def test_every_earlier_release_loads_as_data(name):
    ckpt = checkpoints.Checkpoint(ASSETS / name)  # weights_only: no trust needed
    assert build.module_from_checkpoint(ckpt).hparams.num_classes == 10
    assert not torch.serialization.get_unsafe_globals_in_checkpoint(ASSETS / name)


@pytest.mark.parametrize("name", RELEASES)
def test_an_earlier_release_evaluates_and_resumes(make_cfg, tmp_path, name, monkeypatch):
    path = ASSETS / name
    evaluated = evaluate(
        make_cfg(f"ckpt_path={path}", f"run_dir={tmp_path / 'eval'}", config_name="eval")
    )
    assert 0.0 <= evaluated[metrics.TEST_ACC] <= 1.0
    done = torch.load(path, weights_only=True)["epoch"] + 1
    loads = project_loads(monkeypatch)
    resumed = train(
        make_cfg(
            "precision=16-mixed",
            f"trainer.max_epochs={done + 1}",
            f"ckpt_path={path}",
            f"run_dir={tmp_path / 'resumed'}",
        )
    )
    assert resumed[metrics.EPOCHS] == done + 1
    assert loads == [str(path)]  # one read of the file by the template, for every check


def test_eval_reads_its_checkpoint_once(make_cfg, tmp_path, monkeypatch):
    path = ASSETS / RELEASES[-1]
    loads = project_loads(monkeypatch)
    evaluate(make_cfg(f"ckpt_path={path}", f"run_dir={tmp_path}", config_name="eval"))
    assert loads == [str(path)]


def test_a_checkpoint_that_would_run_code_is_refused_before_it_runs(make_cfg, tmp_path, evil_ckpt):
    path, marker = evil_ckpt
    for run, cfg in (
        (train, make_cfg(f"ckpt_path={path}", f"run_dir={tmp_path / 'train'}")),
        (
            evaluate,
            make_cfg(f"ckpt_path={path}", f"run_dir={tmp_path / 'eval'}", config_name="eval"),
        ),
    ):
        with pytest.raises(UserError) as e:
            run(cfg)
        assert not marker.exists()
        message = str(e.value)
        assert "\n" not in message and "pathlib" in message  # names the type it met
        assert message.endswith("If you trust the file: trust_checkpoint=true")
        assert not (tmp_path / "train").exists()  # refused before the run dir is touched


def test_trust_checkpoint_loads_a_file_you_trust(make_cfg, tmp_path, evil_ckpt):
    path, marker = evil_ckpt
    evaluate(
        make_cfg(
            f"ckpt_path={path}", "trust_checkpoint=true", f"run_dir={tmp_path}", config_name="eval"
        )
    )
    assert marker.exists()  # it did unpickle everything


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["train.py", "eval.py"])
def test_the_commands_refuse_it_in_one_line(tmp_path, tiny_data, evil_ckpt, entry):
    path, marker = evil_ckpt
    args = [o for o in SHRINK if entry == "train.py" or not o.startswith(("model", "module"))]
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / entry),
            *args,
            f"data.data_dir={tiny_data}",
            f"ckpt_path={path}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        timeout=300,
    )
    assert r.returncode == 2 and not marker.exists()
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: ckpt_path={path} holds ") and "trust_checkpoint=true" in line


def test_a_resume_with_a_logger_that_does_not_import_is_one_line_naming_it(make_cfg, tmp_path):
    # A resume looks up each logger's class (does it continue a tracked run?) before building it.
    train(make_cfg("logger=csv", "test=false"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    cfg = make_cfg("logger=csv", "logger.csv._target_=no_such.Logger", f"ckpt_path={last}")
    with pytest.raises(UserError, match=r"^cannot build logger\.csv: ") as e:
        train(cfg)
    assert "\n" not in str(e.value)
