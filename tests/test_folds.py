"""K-fold cross-validation (data/folds.py): the folds, the bad values, resume and the sweep of
every fold. Each DataModule's own use of it: tests/test_data.py, tests/extras/image_folders/."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from cifar_amp import metrics
from cifar_amp.data.cifar import SPECS
from cifar_amp.data.folds import fold_split, stratified_folds
from cifar_amp.errors import UserError
from cifar_amp.training import train
from conftest import REPO, SHRINK, command
from test_resume import EXACT, comparable

# Three classes of unequal sizes (7, 30 and 64 images), in no order.
LABELS = torch.tensor([0] * 7 + [1] * 30 + [2] * 64)[torch.randperm(101)]
FOLD_1 = ("data.folds=3", "data.fold=1")
CRASH = ("+callbacks.crash._target_=test_resume.CrashAt", "+callbacks.crash.step=5")


def test_folds_partition_the_labels_stratified_by_class():
    folds = stratified_folds(LABELS, 5, seed=0)
    assert torch.equal(torch.cat(folds).sort().values, torch.arange(len(LABELS)))
    per_class = torch.stack([torch.bincount(LABELS[f], minlength=3) for f in folds])
    assert (per_class.max(0).values - per_class.min(0).values).tolist() == [1, 0, 1]
    sizes = [len(f) for f in folds]
    assert max(sizes) - min(sizes) <= 1
    assert all(torch.equal(f, f.sort().values) for f in folds)


def test_folds_follow_the_seed():
    folds = stratified_folds(LABELS, 4, seed=3)
    again = stratified_folds(LABELS.clone(), 4, seed=3)
    other = stratified_folds(LABELS, 4, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(folds, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(folds, other, strict=True))


def test_a_fold_validates_and_the_others_train():
    folds = stratified_folds(LABELS, 4, seed=1)
    train_idx, val = fold_split(LABELS, 4, 2, seed=1)
    assert torch.equal(val, folds[2])
    assert torch.equal(train_idx, torch.cat([folds[0], folds[1], folds[3]]).sort().values)


@pytest.mark.slow  # a process of its own: the import of torch
def test_folds_are_the_same_in_another_process():
    # Each DDP rank, and each job of a sweep, computes its fold in its own process.
    code = (
        "import torch; from cifar_amp.data.folds import stratified_folds; "
        "labels = torch.tensor([int(c) for c in input()]); "
        "print([f.tolist() for f in stratified_folds(labels, 3, seed=5)])"
    )
    digits = "".join(map(str, LABELS.tolist()))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, input=digits, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str([f.tolist() for f in stratified_folds(LABELS, 3, seed=5)])


def test_more_folds_than_the_smallest_class_is_one_line_naming_it():
    with pytest.raises(UserError) as e:
        stratified_folds(LABELS, 8, seed=0, class_names=["cat", "dog", "ship"])
    assert str(e.value) == (
        "data.folds=8 is more than the 7 training images of class cat (the smallest class): "
        "every fold must hold each class; use data.folds<=7"
    )
    assert len(stratified_folds(LABELS, 7, seed=0)) == 7


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.folds=1", "data.fold=0"], "data.folds: 1; must be >= 2 (null: no folds)"),
        (["data.folds=3", "data.fold=3"], "data.fold: 3; must be in [0, 3) with data.folds=3"),
        (["data.folds=3", "data.fold=-1"], "data.fold: -1; must be in [0, 3) with data.folds=3"),
        (
            ["data.folds=3"],
            "data.fold: None; set data.fold in [0, 3), the fold that validates (every fold, "
            "one job each: -m data.folds=3 'data.fold=range(3)')",
        ),
        (["data.fold=1"], "data.fold: 1; needs data.folds=K, the number of folds"),
    ],
)
def test_bad_fold_settings_are_one_line_before_the_run(make_cfg, tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    with pytest.raises(UserError) as e:
        train(make_cfg(*overrides, f"run_dir={run_dir}"))
    assert str(e.value) == f"invalid config value for {message}"
    assert not run_dir.exists()


def test_more_folds_than_a_class_has_stops_the_command_before_training(
    monkeypatch, capsys, tmp_path, tiny_data
):
    # Found once CIFAR's labels are read, at setup: one line, exit 2, no step trained.
    labels = SPECS["cifar10"].read(tiny_data / "cifar-10-batches-py", "train")[1]
    fewest = int(torch.bincount(labels).min())
    run_dir = tmp_path / "run"
    args = (*SHRINK, f"data.data_dir={tiny_data}", f"data.folds={fewest + 1}", "data.fold=0")
    code, err = command(monkeypatch, capsys, "train.py", *args, f"hydra.run.dir={run_dir}")
    assert code == 2 and err.count("\n") == 1, err
    found = re.fullmatch(
        rf"error: data.folds={fewest + 1} is more than the (\d+) training images of class "
        rf"(\w+) \(the smallest class\): every fold must hold each class; use data.folds<=\d+\n",
        err,
    )
    assert found and int(found[1]) == fewest, err
    assert not (run_dir / "checkpoints").exists()


def test_a_resume_keeps_its_fold_and_refuses_another(make_cfg, tmp_path):
    train(make_cfg(*EXACT, *FOLD_1, f"run_dir={tmp_path / 'a'}"))
    crashed = tmp_path / "b"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(*EXACT, *FOLD_1, *CRASH, f"run_dir={crashed}"))
    last = crashed / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4  # mid-epoch
    for other, recorded, asked in (
        (("data.folds=3", "data.fold=2"), "data.fold=1", "data.fold=2"),
        (("data.folds=4", "data.fold=1"), "data.folds=3", "data.folds=4"),
        ((), "data.folds=3", "data.folds=None"),
    ):
        with pytest.raises(UserError) as e:
            train(make_cfg(*EXACT, *other, f"run_dir={crashed}", f"ckpt_path={last}"))
        msg = str(e.value)
        assert msg.startswith(f"ckpt_path={last} was trained with {recorded}; this run asks for ")
        assert f"this run asks for {asked}. " in msg and "\n" not in msg
    train(make_cfg(*EXACT, *FOLD_1, f"run_dir={crashed}", f"ckpt_path={last}"))
    assert comparable(crashed) == comparable(tmp_path / "a")


@pytest.mark.slow  # three tiny runs
def test_a_sweep_of_every_fold_runs_one_job_each(monkeypatch, capsys, tmp_path, tiny_data):
    sweep = tmp_path / "sweep"
    args = ("-m", "data.folds=3", "data.fold=range(3)", *SHRINK, f"data.data_dir={tiny_data}")
    code, err = command(monkeypatch, capsys, "train.py", *args, f"hydra.sweep.dir={sweep}")
    assert code == 0, err[-2000:]
    for job in range(3):
        folder = sweep / str(job)
        assert json.loads((folder / "metrics.json").read_text())[metrics.VAL_ACC_BEST] is not None
        assert f"data.fold={job}" in (folder / ".hydra" / "overrides.yaml").read_text()
        config = (folder / "config.yaml").read_text()
        assert "  folds: 3\n" in config and f"  fold: {job}\n" in config
