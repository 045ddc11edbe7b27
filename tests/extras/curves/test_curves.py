"""history.json and curves.png of every run, kept across resumes; the plot command."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from matplotlib.image import imread

from cifar_amp import metrics
from cifar_amp.evaluation import evaluate
from cifar_amp.extras.curves import confusion, plot
from cifar_amp.training import train
from conftest import REPO
from test_full_disk import failed_write, one_line_error
from test_resume import EXACT, CrashAt

CRASH = (f"+callbacks.crash._target_={CrashAt.__module__}.CrashAt", "+callbacks.crash.step=16")
CURVES = (metrics.TRAIN_LOSS, metrics.TRAIN_ACC, metrics.VAL_LOSS, metrics.VAL_ACC)


def history(run_dir) -> dict:
    return json.loads((run_dir / plot.HISTORY).read_text())


def test_every_run_writes_its_history_and_curves_without_a_logger(make_cfg, tmp_path):
    train(make_cfg("trainer.max_epochs=2", pictures=True))  # logger=none (make_cfg)
    rows = history(tmp_path)[plot.EPOCHS]
    assert [r["epoch"] for r in rows] == [0, 1]
    assert all(set(CURVES) <= set(r) for r in rows)
    best = json.loads((tmp_path / "metrics.json").read_text())[metrics.VAL_ACC_BEST]
    assert max(r[metrics.VAL_ACC] for r in rows) == pytest.approx(best)
    lr = history(tmp_path)[plot.LR]
    assert len(lr) == rows[-1]["step"]  # 11 steps an epoch: every step sampled
    assert max(v for _, v in lr) == pytest.approx(0.05)  # the one-cycle peak (make_cfg's lr)
    picture = imread(tmp_path / "curves.png")
    assert picture.shape[0] > 100 and picture.shape[1] > 300


def test_without_matplotlib_a_run_keeps_its_history_and_says_why_no_png(
    make_cfg, tmp_path, monkeypatch, caplog
):
    real = plot.importlib.util.find_spec
    monkeypatch.setattr(
        plot.importlib.util, "find_spec", lambda n, *a: None if n == "matplotlib" else real(n, *a)
    )
    result = train(make_cfg(pictures=True))
    assert result[metrics.TEST_ACC] >= 0 and history(tmp_path)[plot.EPOCHS]
    assert not (tmp_path / "curves.png").exists()
    assert "curves.png not drawn: matplotlib is not installed" in caplog.text


def test_a_full_disk_at_the_history_keeps_the_last_whole_one(make_cfg, tmp_path, full_disk, capsys):
    full_disk(plot.HISTORY, after=1)  # epoch 0's fits, epoch 1's does not
    short = ("trainer.max_epochs=2", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1")
    err = one_line_error(capsys, lambda: train(make_cfg(*short, pictures=True)))
    last = tmp_path / "checkpoints" / "last.ckpt"  # of epoch 0: checkpoints come after the history
    then = f"resume with ckpt_path={last} once there is room"
    assert re.fullmatch(failed_write(tmp_path / plot.HISTORY, then), err)
    assert [r["epoch"] for r in history(tmp_path)[plot.EPOCHS]] == [0]
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.slow  # three runs
def test_history_survives_a_crash_and_a_resume_into_a_new_run_dir(make_cfg, tmp_path):
    """Epoch 0 before the crash (at step 16, mid epoch 1) is kept, and the resumed run's history
    is the uninterrupted run's (deterministic CPU run)."""
    common = (*EXACT, "trainer.max_epochs=2")
    train(make_cfg(*common, f"run_dir={tmp_path / 'ref'}", pictures=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(*common, *CRASH, f"run_dir={tmp_path / 'old'}", pictures=True))
    assert [r["epoch"] for r in history(tmp_path / "old")[plot.EPOCHS]] == [0]
    last = tmp_path / "old" / "checkpoints" / "last.ckpt"
    train(make_cfg(*common, f"run_dir={tmp_path / 'new'}", f"ckpt_path={last}", pictures=True))
    assert history(tmp_path / "new") == history(tmp_path / "ref")
    assert (tmp_path / "new" / "curves.png").is_file()


def fake_history(run_dir, epochs: int, scale: float) -> None:
    rows = [
        {"epoch": e, "step": 3 * (e + 1), **{k: scale / (e + 1) for k in CURVES}}
        for e in range(epochs)
    ]
    run_dir.mkdir(parents=True)
    lr = [[e / 3, 0.1 * scale] for e in range(3 * epochs)]
    (run_dir / plot.HISTORY).write_text(json.dumps({plot.EPOCHS: rows, plot.LR: lr}))


def test_plot_overlays_runs_and_multirun_dirs(tmp_path, capsys):
    fake_history(tmp_path / "sweep" / "0", 3, 1.0)
    fake_history(tmp_path / "sweep" / "1", 2, 2.0)
    out = tmp_path / "both.png"
    plot.main([str(tmp_path / "sweep"), "-o", str(out)])
    assert capsys.readouterr().out.strip() == f"wrote {out} (2 runs: 0, 1)"  # the jobs
    assert imread(out).shape[1] > 300
    fig = plot.figure(plot.load([str(tmp_path / "sweep" / "0"), str(tmp_path / "sweep" / "1")]))
    loss, _, lr = fig.axes
    assert len(loss.lines) == 4 and len(lr.lines) == 2  # train + val per run; one rate each
    assert loss.get_legend_handles_labels()[1] == ["0", "1"]
    assert list(loss.lines[2].get_xdata()) == [1, 2]  # run 1: after epochs 1 and 2


@pytest.mark.parametrize("make", ["missing", "empty", "broken"])
def test_plot_refuses_bad_input_in_one_line(tmp_path, capsys, make):
    target = tmp_path / "run"
    if make != "missing":
        target.mkdir()
    if make == "broken":
        (target / plot.HISTORY).write_text('{"epochs": [{"step": 3}]}')
    with pytest.raises(SystemExit) as e:
        plot.main([str(target)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {target}")
    reason = {"missing": "no such directory", "empty": "no history.json", "broken": "not a history"}
    assert reason[make] in err


@pytest.mark.slow
def test_plot_command(make_cfg, tmp_path):
    train(make_cfg(pictures=True))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cifar_amp.extras.curves.plot",
            str(tmp_path),
            "-o",
            str(tmp_path / "x.png"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 'x.png'} (1 run: ")
    bad = subprocess.run(
        [sys.executable, "-m", "cifar_amp.extras.curves.plot", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_plot_without_matplotlib_names_its_pip_command_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plot, "load", lambda paths: {"run": {plot.EPOCHS: []}})
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as e:
        plot.main([str(tmp_path), "-o", str(tmp_path / "c.png")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and not (tmp_path / "c.png").exists()
    assert err.startswith("error: this command needs matplotlib, which is not installed here: ")
    assert "pip install 'matplotlib" in err


def test_each_test_draws_its_confusion_matrix_with_the_class_names(make_cfg, marked_run, tmp_path):
    assert imread(marked_run / confusion.PICTURE).shape[0] > 300  # train.py's test
    last = marked_run / "checkpoints" / "last.ckpt"
    evaluate(make_cfg(f"ckpt_path={last}", config_name="eval", pictures=True))
    assert imread(tmp_path / confusion.PICTURE).shape[0] > 300  # eval.py's
    matrix = torch.tensor([[3, 1], [0, 4]])
    ax = confusion.figure(matrix, ["cat", "dog"]).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["cat", "dog"]
    assert [t.get_text() for t in ax.texts] == ["0.75", "0.25", "0.00", "1.00"]
    assert ax.get_title() == "test confusion: 8 images, 87.5% right"


@pytest.mark.parametrize("n", [100, 400])
def test_many_classes_are_each_named_and_no_two_names_overlap(n):
    names = [f"class_{i:03d}" for i in range(n)]
    fig = confusion.figure(torch.eye(n, dtype=torch.long), names)
    fig.draw_without_rendering()
    ax = fig.axes[0]
    rows = ax.get_yticklabels()
    assert [t.get_text() for t in rows] == names and not ax.texts  # no shares in tiny cells
    row_height = ax.get_window_extent().height / n
    assert max(t.get_window_extent().height for t in rows) <= row_height
    assert fig.get_size_inches()[1] <= 26  # the matrix: past 173 classes, smaller names
