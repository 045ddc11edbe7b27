"""The multirun extra's summary (src/cifar_amp/extras/multirun/summary.py): a sweep's jobs grouped
by setting, over seeds and folds, mean +- std (n) per metric, failed jobs named; written at the
end of a sweep and by its command."""

import csv
import json
import statistics

import pytest
from omegaconf import OmegaConf
from PIL import Image

from cifar_amp import metrics
from cifar_amp.extras.multirun import summary
from conftest import SHRINK, command

COMMON = ("trainer=cpu", "model.width=8")  # overrides every job of a fake sweep has
PRECISIONS = ("32-true", "bf16-mixed")
MODULE = "-m cifar_amp.extras.multirun.summary"


def write_job(sweep, num, overrides, result=None, error=None):
    """A job's directory as a sweep leaves it: Hydra's overrides.yaml, and its metrics.json
    when it finished or its error.txt when it failed."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create([*overrides, *COMMON]), job / ".hydra" / "overrides.yaml")
    if result is not None:
        (job / "metrics.json").write_text(json.dumps(result))
    if error is not None:
        (job / "error.txt").write_text(error + "\n")


def result(test_acc, val_acc_best):
    """A metrics.json with the keys that are no numbers (skipped) beside two that are."""
    return {
        metrics.PRECISION: "bf16-mixed",
        metrics.TEST_ACC: test_acc,
        metrics.VAL_ACC_BEST: val_acc_best,
        metrics.TEST_ACC_PER_CLASS: {"cat": 0.5, "dog": 0.25},
        metrics.TESTED_CKPT: "checkpoints/best.ckpt",
    }


def grid(sweep, values):
    """`-m precision=32-true,bf16-mixed seed=0,1,2`, job by job in Hydra's order: job i's
    metrics are values[i] (test/acc, val/acc_best), None for a job that failed."""
    settings = [(p, s) for p in PRECISIONS for s in range(3)]
    for num, ((precision, seed), acc) in enumerate(zip(settings, values, strict=True)):
        overrides = (f"precision={precision}", f"seed={seed}")
        if acc is None:
            write_job(sweep, num, overrides, error="invalid config value for precision: boom")
        else:
            write_job(sweep, num, overrides, result(*acc))


def rows(sweep):
    with open(sweep / "summary.csv") as f:
        return list(csv.DictReader(f))


ACCS = [(0.61, 0.63), (0.65, 0.66), (0.60, 0.64), (0.70, 0.71), (0.72, 0.69), (0.75, 0.76)]


def test_a_precision_by_seed_sweep_is_two_groups_of_three(tmp_path):
    grid(tmp_path, ACCS)
    table, _ = summary.write(tmp_path)
    got = rows(tmp_path)
    assert [r["precision"] for r in got] == list(PRECISIONS)
    assert "seed" not in got[0] and "trainer" not in got[0]  # grouped over; common to all
    for row, accs in zip(got, (ACCS[:3], ACCS[3:]), strict=True):
        for i, name in enumerate((metrics.TEST_ACC, metrics.VAL_ACC_BEST)):
            values = [a[i] for a in accs]
            assert float(row[f"{name}_mean"]) == pytest.approx(statistics.mean(values))
            assert float(row[f"{name}_std"]) == pytest.approx(statistics.stdev(values))
            assert row[f"{name}_n"] == "3"
        assert (row["jobs"], row["failed"], row["failed_jobs"]) == ("3", "0", "")
    skipped = (metrics.PRECISION, metrics.TEST_ACC_PER_CLASS, metrics.TESTED_CKPT)
    assert not [s for s in skipped if f"{s}_mean" in got[0]]
    # the printed table: one row per group, mean +- std (n) of the main metrics
    mean = statistics.mean(a[0] for a in ACCS[3:])
    std = statistics.stdev(a[0] for a in ACCS[3:])
    assert f"| precision=bf16-mixed | 3 | 0 | {mean:.3g} +- {std:.3g} (3) |" in table
    assert table in (tmp_path / "summary.md").read_text()
    assert "sample standard deviation (n-1)" in (tmp_path / "summary.md").read_text()


def test_a_failed_job_is_counted_and_named_and_null_metrics_counted_per_metric(tmp_path):
    accs = [*ACCS[:4], (0.72, None), None]  # job 4: no val/acc_best; job 5 failed
    grid(tmp_path, accs)
    summary.write(tmp_path)
    fp32, bf16 = rows(tmp_path)
    assert (fp32["failed"], bf16["failed"], bf16["failed_jobs"]) == ("0", "1", "5")
    assert bf16[f"{metrics.TEST_ACC}_n"] == "2" and bf16[f"{metrics.VAL_ACC_BEST}_n"] == "1"
    assert float(bf16[f"{metrics.TEST_ACC}_mean"]) == pytest.approx(statistics.mean([0.70, 0.72]))
    assert float(bf16[f"{metrics.VAL_ACC_BEST}_mean"]) == pytest.approx(0.71)
    assert bf16[f"{metrics.VAL_ACC_BEST}_std"] == ""  # one value: no sample std
    md = (tmp_path / "summary.md").read_text()
    assert "6 jobs in 2 groups" in md and "1 failed" in md
    assert "| precision=bf16-mixed | 3 | 1 (job 5) |" in md
    expected = "- job 5 (precision=bf16-mixed seed=2): invalid config value for precision: boom"
    assert expected in md


def test_a_value_that_diverged_makes_its_groups_mean_nan_and_no_other(tmp_path):
    accs = [*ACCS[:5], (float("nan"), 0.7)]  # json writes NaN, and reads it back
    grid(tmp_path, accs)
    table, _ = summary.write(tmp_path)
    fp32, bf16 = rows(tmp_path)
    assert bf16[f"{metrics.TEST_ACC}_mean"] == bf16[f"{metrics.TEST_ACC}_std"] == "nan"
    assert bf16[f"{metrics.TEST_ACC}_n"] == "3"
    values = [a[0] for a in ACCS[:3]]
    assert float(fp32[f"{metrics.TEST_ACC}_std"]) == pytest.approx(statistics.stdev(values))
    assert "| precision=bf16-mixed | 3 | 0 | nan +- nan (3) |" in table


def test_a_fold_sweep_is_one_group_of_five(tmp_path):
    accs = [0.5, 0.55, 0.6, 0.58, 0.52]
    for fold, acc in enumerate(accs):
        write_job(tmp_path, fold, (f"data.fold={fold}",), result(acc, acc))
    summary.write(tmp_path, [metrics.TEST_ACC])
    [row] = rows(tmp_path)
    assert (row["jobs"], row[f"{metrics.TEST_ACC}_n"]) == ("5", "5")
    assert float(row[f"{metrics.TEST_ACC}_std"]) == pytest.approx(statistics.stdev(accs))
    assert "| all jobs | 5 | 0 |" in (tmp_path / "summary.md").read_text()


def test_the_chart_is_an_image_with_a_panel_per_main_metric(tmp_path):
    grid(tmp_path, ACCS)
    summary.write(tmp_path)
    one_panel = tmp_path / "one"
    grid(one_panel, ACCS)
    summary.write(one_panel, [metrics.TEST_ACC])
    with Image.open(tmp_path / "summary.png") as two, Image.open(one_panel / "summary.png") as one:
        assert two.format == one.format == "PNG"
        assert two.height > 1.5 * one.height and two.width == one.width


def test_the_end_of_a_sweep_prints_the_table_and_names_the_failed_jobs(tmp_path, capsys):
    grid(tmp_path, [*ACCS[:5], None])
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit) as e:
        summary.SweepSummary().on_multirun_end(config)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "| precision=32-true | 3 | 0 |" in out and (tmp_path / "summary.md").is_file()
    assert err.splitlines() == [
        f"error: 1 job(s) of the sweep in {tmp_path} failed:",
        "  job 5 (precision=bf16-mixed seed=2): invalid config value for precision: boom",
    ]


def test_the_command_refuses_what_is_no_sweep_in_one_line(tmp_path, monkeypatch, capsys):
    grid(tmp_path / "sweep", ACCS)
    (tmp_path / "empty").mkdir()
    for path, why in (
        (tmp_path / "nope", "no such directory"),
        (tmp_path / "sweep" / "0", "the directory of one run, not of a sweep"),
        (tmp_path / "empty", "not a sweep's directory"),
    ):
        code, err = command(monkeypatch, capsys, MODULE, str(path))
        assert code == 2 and err.startswith(f"error: {path}: {why}") and err.count("\n") == 1
    code, err = command(monkeypatch, capsys, MODULE, str(tmp_path / "sweep"), "--metrics", "nope")
    assert code == 2 and err.startswith("error: --metrics nope: ") and err.count("\n") == 1
    assert not list(tmp_path.rglob("summary.*"))  # refused before anything is written


@pytest.mark.slow
def test_a_real_sweep_ends_with_its_summary(tmp_path, tiny_data, monkeypatch, capsys):
    sweep = tmp_path / "sweep"
    code, err = command(
        monkeypatch,
        capsys,
        "train.py",
        "-m",
        "seed=0,1",
        *SHRINK,
        f"data.data_dir={tiny_data}",
        f"hydra.sweep.dir={sweep}",
    )
    assert code == 0, err[-3000:]
    [row] = rows(sweep)
    assert (row["jobs"], row["failed"], row[f"{metrics.TEST_ACC}_n"]) == ("2", "0", "2")
    assert "| all jobs | 2 | 0 |" in (sweep / "summary.md").read_text()
    code, _ = command(monkeypatch, capsys, MODULE, str(sweep))  # and again, afterwards
    assert code == 0 and rows(sweep) == [row]


def test_the_table_shows_the_metric_the_runs_monitored(tmp_path):
    """A sweep ranked by F1 (monitor.metric=f1) shows test/f1 and val/f1_best by default."""
    for num, (f1, best) in enumerate([(0.5, 0.6), (0.7, 0.8)]):
        scores = {"test/f1": f1, metrics.best("f1"): best, metrics.TEST_LOSS: 1.0}
        write_job(tmp_path, num, ("monitor.metric=f1", f"seed={num}"), scores)
    jobs = summary.collect(tmp_path)
    assert summary.chosen_metrics(jobs, ()) == ["test/f1", "val/f1_best"]
