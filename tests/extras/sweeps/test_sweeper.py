"""The Optuna sweeper (src/cifar_amp/extras/sweeps/hydra_plugins/optuna_asktell_sweeper): its search space, the values it
hands to jobs, how it records each job's end; and end to end on a task without torch
(tests/extras/sweeps/examples/sweep_app.py): pruning, resuming, failures, parallel jobs with their own devices."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper import compat
from hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper import sweeper as S
from hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper.trial import PRUNED_AT

from conftest import REPO

# The sweeps extra's: without it this module skips (collecting it must not fail `pytest -m gpu`).
optuna = pytest.importorskip("optuna")
from optuna.distributions import CategoricalDistribution as Cat  # noqa: E402
from optuna.distributions import FloatDistribution, IntDistribution  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

APP = Path(__file__).parent / "examples" / "sweep_app.py"
optuna.logging.set_verbosity(optuna.logging.WARNING)


def parse(line: str):
    return OverridesParser.create().parse_override(line)


@pytest.mark.parametrize(
    "sweep,expected",
    [
        ("interval(0.1, 1.0)", FloatDistribution(0.1, 1.0)),
        ("tag(log, interval(1e-5, 1e-2))", FloatDistribution(1e-5, 1e-2, log=True)),
        ("range(8, 33, 8)", IntDistribution(8, 32, step=8)),
        ("range(0.5, 2.0, 0.5)", Cat((0.5, 1.0, 1.5))),  # floats: Optuna's int range takes none
        ("range(3, 0, -1)", Cat((3, 2, 1))),
        ("choice(256, 512)", Cat((256, 512))),
        ("32-true,bf16-mixed", Cat(("32-true", "bf16-mixed"))),
    ],
)
def test_hydra_sweeps_become_optuna_distributions(sweep, expected):
    assert S.distribution(parse(f"k={sweep}")) == expected


def test_the_command_line_fixes_or_searches_a_key_over_the_config():
    params = ["a=choice(1, 2)", "b=interval(0, 1)", "d=choice(x, y)"]
    space, fixed = S.search_space(params, ["a=3", "b=choice(0.1, 0.2)", "c=x"])
    assert space == {"b": Cat((0.1, 0.2)), "d": Cat(("x", "y"))}
    assert fixed == ["a=3", "c=x"]


@pytest.mark.parametrize(
    "value",
    [
        "32-true",
        "it's",
        "a,b",
        "back\\",
        "\\'",
        " spaced ",
        "null",
        "1",
        "",
        "nan",
        "x=y",
        None,
        True,
        3,
        0.1,
        1e-5,
    ],
)
def test_a_trial_value_reaches_the_job_unchanged(value):
    assert parse(f"k={S.override_value(value)}").value() == value


def test_only_strings_that_need_quotes_get_them():  # the job summaries show them
    assert [S.override_value(v) for v in ("32-true", "1", "a,b")] == ["32-true", "'1'", "'a,b'"]


def job_return(status: JobStatus, value) -> JobReturn:
    """As Hydra's run_job makes it: the task's value, or what it raised."""
    ret = JobReturn(status=status)
    ret.return_value = value
    return ret


@pytest.mark.parametrize(
    "ret,pruned_at,state,reason",
    [
        (job_return(JobStatus.COMPLETED, 0.5), None, TrialState.COMPLETE, ""),
        (job_return(JobStatus.COMPLETED, 0.5), 2, TrialState.PRUNED, ""),
        (job_return(JobStatus.FAILED, optuna.TrialPruned("at 1")), None, TrialState.PRUNED, ""),
        (job_return(JobStatus.COMPLETED, math.nan), None, TrialState.FAIL, "returned nan"),
        (job_return(JobStatus.COMPLETED, None), None, TrialState.FAIL, "returned None"),
        (
            job_return(JobStatus.FAILED, RuntimeError("boom")),
            None,
            TrialState.FAIL,
            "RuntimeError: boom",
        ),
        (None, None, TrialState.FAIL, "the launcher lost the job"),
    ],
)
def test_each_end_of_a_job_is_recorded(ret, pruned_at, state, reason):
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    trial.report(0.25, step=0)
    if pruned_at is not None:
        trial.set_user_attr(PRUNED_AT, pruned_at)
    assert S.tell(study, trial, ret) == (reason, False)
    assert study.trials[0].state == state
    if state == TrialState.PRUNED:  # Optuna keeps the last reported value
        assert study.trials[0].value == 0.25


def test_a_job_reopens_its_trial_by_the_id_it_is_given():
    study = optuna.create_study()
    study.ask()
    asked = study.ask()  # the second: its number and its storage id could differ
    reopened = optuna.trial.Trial(study, compat.trial_id(asked))  # as the job's process does
    reopened.report(0.5, step=1)
    assert reopened.number == asked.number == 1
    assert study.get_trials(deepcopy=False)[1].intermediate_values == {1: 0.5}


def test_a_changed_search_space_is_refused():
    study = optuna.create_study(study_name="s")
    study.ask({"c": Cat(("a", "b")), "x": FloatDistribution(0, 1)})
    S.check_space(study, {"c": Cat(("a", "b")), "y": IntDistribution(1, 3)})  # new keys: fine
    with pytest.raises(ValueError, match=r"^c: .*Study s .*new hydra.sweeper.study_name"):
        S.check_space(study, {"c": Cat(("a", "x"))})


def sweep(tmp_path, *args, name="sweep", check=True):
    db = tmp_path / "s.db"
    cmd = [
        sys.executable,
        str(APP),
        "-m",
        "hydra/sweeper=optuna_asktell",
        "hydra.sweeper.direction=maximize",
        f"hydra.sweeper.storage=sqlite:///{db}",
        f"hydra.sweep.dir={tmp_path / name}",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return optuna.load_study(study_name="study", storage=f"sqlite:///{db}"), p


def jobs(sweep_dir) -> list[dict]:
    found = {int(p.parent.name): json.loads(p.read_text()) for p in sweep_dir.glob("*/job.json")}
    return [found[i] for i in sorted(found)]


# Every combination once: x=0.9 scores 0.2 (c=a) or 0.3 (c=b) at epoch 1, below the threshold;
# x=0.3 scores 0.5 or 0.6.
BRUTE_FORCE = "hydra.sweeper.sampler._target_=optuna.samplers.BruteForceSampler"
THRESHOLD = (
    "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
    "+hydra.sweeper.pruner.lower=0.5",
    "+hydra.sweeper.pruner.n_warmup_steps=1",
)


@pytest.mark.slow
def test_pruned_trials_stop_early_and_are_recorded_pruned(tmp_path):
    study, _ = sweep(
        tmp_path,
        "x=choice(0.3, 0.9)",
        "c=choice(a, b)",
        "hydra.sweeper.n_trials=4",
        BRUTE_FORCE,
        *THRESHOLD,
    )
    states = {(t.params["x"], t.params["c"]): t for t in study.trials}
    assert {k: t.state for k, t in states.items()} == {
        (0.3, "a"): TrialState.COMPLETE,
        (0.3, "b"): TrialState.COMPLETE,
        (0.9, "a"): TrialState.PRUNED,
        (0.9, "b"): TrialState.PRUNED,
    }
    assert [len(states[0.9, c].intermediate_values) for c in "ab"] == [2, 2]  # epochs 0 and 1
    assert [len(states[0.3, c].intermediate_values) for c in "ab"] == [4, 4]
    results = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"x": 0.3, "c": "b"}
    assert results["best_value"] == pytest.approx(1.1)
    assert sorted(r["state"] for r in results["trials"]) == ["COMPLETE"] * 2 + ["PRUNED"] * 2
    assert not list((tmp_path / "sweep").glob("*/error.txt"))


@pytest.mark.slow
def test_restrict_edits_the_configured_space_and_the_command_line_still_wins(tmp_path):
    restrict = (
        "+hydra.sweeper.params.c='choice(a, b)'",
        "+hydra.sweeper.restrict._target_=sweep_app.only_a",
    )
    args = ("+hydra.sweeper.params.x='choice(0.1, 0.3)'", "hydra.sweeper.n_trials=3", "epochs=1")
    study, _ = sweep(tmp_path, *args, *restrict)
    assert [t.params["c"] for t in study.trials] == ["a"] * 3
    (cli := tmp_path / "cli").mkdir()  # another space: another study
    study, _ = sweep(cli, *args, *restrict, "c=choice(b)")
    assert [t.params["c"] for t in study.trials] == ["b"] * 3


@pytest.mark.slow
def test_a_rerun_resumes_the_study_without_replaying_its_trials(tmp_path):
    args = (
        "x=interval(0, 1)",
        "c=choice(a, b)",
        "hydra.sweeper.n_trials=3",
        "+hydra.sweeper.sampler.seed=1",
    )
    sweep(tmp_path, *args, name="first")
    study, _ = sweep(tmp_path, *args, name="second")
    assert len(study.trials) == 6
    assert {t.state for t in study.trials} <= {TrialState.COMPLETE, TrialState.PRUNED}
    # a fixed seed on its own would ask for trials 0-2 again
    first, second = ([t.params["x"] for t in study.trials[i : i + 3]] for i in (0, 3))
    assert not set(first) & set(second)
    assert [j["trial"] for j in jobs(tmp_path / "second")] == [3, 4, 5]


@pytest.mark.slow
def test_failed_jobs_fail_alone_are_named_and_the_sweep_goes_on(tmp_path):
    study, p = sweep(
        tmp_path,
        "fail=choice(none, nan_value, raise, pruned)",
        "hydra.sweeper.n_trials=4",
        BRUTE_FORCE,
        "+hydra.callbacks.summary._target_=cifar_amp.extras.multirun.summary.SweepSummary",
        check=False,
    )
    assert {t.params["fail"]: t.state for t in study.trials} == {
        "none": TrialState.COMPLETE,
        "nan_value": TrialState.FAIL,
        "raise": TrialState.FAIL,
        "pruned": TrialState.PRUNED,
    }
    failed = {t.number: t.params["fail"] for t in study.trials if t.state == TrialState.FAIL}
    assert p.returncode == 2
    assert "2 job(s) of the sweep" in p.stderr
    for job, fail in failed.items():  # job i runs trial i here
        reason = (tmp_path / "sweep" / str(job) / "error.txt").read_text()
        assert (
            reason
            == {
                "nan_value": f"trial {job}: returned nan\n",
                "raise": f"trial {job}: RuntimeError: boom\n",
            }[fail]
        )
        assert f"job {job} (fail={fail}): {reason.strip()}" in p.stderr


@pytest.mark.slow
def test_parallel_jobs_each_get_their_own_process_device_and_threads(tmp_path):
    args = (
        f"hydra.searchpath=[file://{REPO / 'configs'}]",
        "hydra/launcher=local",
        "hydra.sweeper.n_jobs=2",
        "x=interval(0, 1)",
        "sleep=0.5",
    )
    sweep(tmp_path, *args, "hydra.sweeper.n_trials=4", "hydra.sweeper.devices=[3,5]")
    ran = jobs(tmp_path / "sweep")
    assert [j["cuda"] for j in ran] == ["3", "5", "3", "5"]
    assert [j["trial"] for j in ran] == [0, 1, 2, 3]
    assert {j["threads"] for j in ran} == {str(max(1, len(os.sched_getaffinity(0)) // 2))}
    assert ran[1]["t0"] < ran[0]["t1"] and ran[0]["pid"] != ran[1]["pid"]  # at the same time
    # without devices, a job sees the GPUs this command sees (submitit alone would hide them)
    sweep(tmp_path, *args, "hydra.sweeper.n_trials=2", name="nodevices")
    assert [j["cuda"] for j in jobs(tmp_path / "nodevices")] == [None, None]


def test_without_optuna_the_sweep_stops_in_one_line(monkeypatch, capsys):
    # Hydra's CompactHydraException: 3 lines, exit 1.
    monkeypatch.setitem(sys.modules, "optuna", None)
    sweeper = S.OptunaAskTellSweeper("s", None, "maximize", 1, 1, {}, {}, None, None)
    with pytest.raises(SystemExit) as e:
        sweeper.sweep([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(
        "error: hydra/sweeper=optuna_asktell needs optuna, which is not installed here: "
        "pip install -e '.[sweeps]'"
    )
