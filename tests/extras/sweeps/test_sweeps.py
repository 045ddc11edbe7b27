"""hparams_search=optuna: the searched keys exist, the objective is the best epoch's accuracy,
and a real offline search runs, prunes, stores its study and resumes it, also two trials at a
time (the sweeper itself: tests/extras/sweeps/test_sweeper.py)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.utils import call
from hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper.sweeper import (
    search_space as parse_space,
)

from cifar_amp import config, metrics
from cifar_amp.extras.sweeps import machine
from cifar_amp.training import train
from conftest import REPO, SHRINK, compose_cfg

# The sweeps extra's: without it this module skips (collecting it must not fail `pytest -m gpu`).
optuna = pytest.importorskip("optuna")
from optuna.distributions import CategoricalDistribution  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

SEARCHES = ("optuna", "optuna_cpu")
HERE = Path(__file__).parent


def search_space(name: str = "optuna") -> dict:
    params = compose_cfg("train", [f"hparams_search={name}"], return_hydra_config=True)
    space, fixed = parse_space([f"{k}={v}" for k, v in params.hydra.sweeper.params.items()], [])
    assert not fixed
    return space


@pytest.mark.parametrize("name", SEARCHES)
def test_every_searched_value_is_a_valid_config(make_cfg, name):
    space = search_space(name)
    assert set(space) >= {
        "module.optimizer.lr",
        "module.optimizer.weight_decay",
        "data.batch_size",
        "module.label_smoothing",
        "precision",
    }
    for key, dist in space.items():
        values = (
            dist.choices if isinstance(dist, CategoricalDistribution) else (dist.low, dist.high)
        )
        for value in values:
            make_cfg(f"hparams_search={name}", f"{key}={value}")  # composes and validates


@pytest.mark.native  # asks this CPU (make test-avx2: capped at AVX2)
def test_the_cpu_search_spends_no_trial_on_float16_autocast():
    assert "16-mixed" in search_space("optuna").pop("precision").choices
    assert search_space("optuna_cpu").pop("precision").choices == ("32-true", "bf16-mixed")
    cpu = compose_cfg("train", ["hparams_search=optuna_cpu"], return_hydra_config=True)
    assert cpu.hydra.sweeper.study_name != "cifar_amp"  # another space, another study


def searched_here(monkeypatch, bf16: bool, fp16: bool, *overrides: str, device=None) -> dict:
    """The precision choices hparams_search=optuna searches on a machine whose device has
    native bfloat16 / float16 kernels or not (`device`: the one the trials get, if not asked)."""
    monkeypatch.setattr(machine, "native", lambda _: (bf16, fp16))
    if device:
        monkeypatch.setattr(machine, "_device", lambda _: device)
        monkeypatch.setattr(machine.torch.cuda, "get_device_name", lambda: "Tesla V100")
    cfg = compose_cfg("train", ["hparams_search=optuna", *overrides], return_hydra_config=True)
    params = {str(k): str(v) for k, v in cfg.hydra.sweeper.params.items()}
    space, _ = parse_space(
        [f"{k}={v}" for k, v in call(cfg.hydra.sweeper.restrict, params, cfg).items()], []
    )
    return space["precision"].choices


def test_the_search_leaves_out_the_modes_this_machine_emulates_and_says_so(monkeypatch, caplog):
    # A CPU without AMX-FP16 (this 2-core box, most CPUs): 16-mixed is left out.
    assert searched_here(monkeypatch, True, False, "trainer=cpu") == ("32-true", "bf16-mixed")
    said = [r.getMessage() for r in caplog.records if r.name == machine.__name__]
    assert said == [
        "Not searching precision 16-mixed: this machine's CPU emulates float16, many times "
        "slower than 32-true. Searching 32-true, bf16-mixed (to search it anyway, give "
        "precision='choice(...)' on the command line)"
    ]
    caplog.clear()
    # A CPU without bfloat16 instructions either (an AVX2 CPU): 32-true alone.
    monkeypatch.setattr(machine, "native", lambda _: (False, False))
    params = {"precision": "choice(32-true, 16-mixed, bf16-mixed)"}
    assert machine.fast_here(params, compose_cfg("train", ["trainer=cpu"])) == {
        "precision": "32-true"
    }
    assert (
        "Not searching precision 16-mixed, bf16-mixed: this machine's CPU emulates float16 "
        "and bfloat16, many times slower than 32-true. Searching 32-true " in caplog.text
    )
    caplog.clear()
    # A CPU with them (AMX-FP16) keeps it; a GPU without bfloat16 leaves bf16-mixed out.
    assert "16-mixed" in searched_here(monkeypatch, True, True, "trainer=cpu")
    assert not caplog.records
    gpu = searched_here(monkeypatch, False, True, device="cuda")
    assert gpu == ("32-true", "16-mixed")
    assert (
        "Not searching precision bf16-mixed: this machine's Tesla V100 emulates bfloat16"
        in caplog.text
    )


@pytest.mark.native  # asks this CPU (make test-avx2: capped at AVX2)
def test_a_precision_choice_on_the_command_line_is_searched_as_given(tmp_path):
    """The command line goes over the restricted params (the sweeper: search_space)."""
    params = machine.fast_here(
        {"precision": "choice(32-true, 16-mixed)"}, compose_cfg("train", ["trainer=cpu"])
    )
    space, fixed = parse_space(
        [f"{k}={v}" for k, v in params.items()], ["precision=choice(16-mixed,32-true)"]
    )
    assert space["precision"].choices == ("16-mixed", "32-true") and not fixed


def test_objective_is_the_best_epoch_not_the_last(make_cfg, tmp_path):
    # On the tiny data this learning rate, unclipped, peaks in epoch 0 (0.5), then falls (0.0,
    # 0.25, 0.25).
    lr = ("module.optimizer.lr=0.1", "trainer.gradient_clip_val=null")
    cfg = make_cfg("trainer.max_epochs=4", "logger=csv", *lr)
    result = train(cfg)
    with open(tmp_path / "metrics.csv") as f:
        per_epoch = [float(r[metrics.VAL_ACC]) for r in csv.DictReader(f) if r.get(metrics.VAL_ACC)]
    assert len(per_epoch) == 4
    assert per_epoch[-1] < max(per_epoch), "no peak before the last epoch: pick another lr"
    assert result[metrics.VAL_ACC_BEST] == pytest.approx(max(per_epoch))
    assert compose_cfg("train", ["hparams_search=optuna"]).optimized_metric == metrics.VAL_ACC_BEST


def run_search(cwd, sweep_dir, data_dir, *args) -> subprocess.CompletedProcess:
    """train.py's Optuna search of two trials on `data_dir`, shrunk; its jobs can import the
    modules beside this file (rendezvous.py)."""
    # a value fixed on the command line would not be searched
    shrink = [o for o in SHRINK if not o.startswith(("data.batch_size", "module.optimizer.lr"))]
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        f"hydra.sweep.dir={sweep_dir}",
        *shrink,
        f"data.data_dir={data_dir}",
        "trainer.max_epochs=3",
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(HERE)])}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# Prunes every trial after its epoch 1 (validation accuracy is below 1.1), whatever the numbers.
PRUNE_AT_EPOCH_1 = (
    "hydra.sweeper.pruner._target_=optuna.pruners.ThresholdPruner",
    "~hydra.sweeper.pruner.n_startup_trials",
    "+hydra.sweeper.pruner.lower=1.1",
    "hydra.sweeper.pruner.n_warmup_steps=1",
)


@pytest.mark.slow
def test_optuna_search_prunes_runs_offline_and_resumes(tmp_path, tiny_data):
    first, second = tmp_path / "first", tmp_path / "second"
    proc = run_search(tmp_path, first, tiny_data, "~callbacks.optuna_pruning")  # no pruning
    db = tmp_path / "logs" / "train" / "optuna" / "cifar_amp.db"  # the default storage, under cwd
    assert db.is_file()
    run_search(tmp_path, second, tiny_data, *PRUNE_AT_EPOCH_1)  # the same study, resumed

    study = optuna.load_study(study_name="cifar_amp", storage=f"sqlite:///{db}")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2 + [TrialState.PRUNED] * 2
    done, pruned = study.trials[:2], study.trials[2:]
    assert [sorted(t.intermediate_values) for t in pruned] == [[0, 1]] * 2  # one value an epoch
    assert [t.user_attrs["pruned_at"] for t in pruned] == [1, 1]
    # A pruned job stops early but ends as any other: tested, metrics.json, no error.
    results = [
        json.loads(p.read_text()) for d in (first, second) for p in sorted(d.glob("*/metrics.json"))
    ]
    assert [r[metrics.EPOCHS] for r in results] == [3, 3, 2, 2]
    assert all(r[metrics.TEST_ACC] is not None for r in results)
    assert not list(second.glob("*/error.txt"))
    assert sorted(t.value for t in done) == pytest.approx(
        sorted(r[metrics.VAL_ACC_BEST] for r in results[:2])
    )
    best = yaml.safe_load((second / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(t.value for t in done))
    assert set(best["best_params"]) == set(search_space())
    assert [t["state"] for t in best["trials"]] == ["PRUNED", "PRUNED"]
    if "16-mixed" in machine.emulated("cpu"):  # as on most CPUs: left out of the search
        assert "Not searching precision 16-mixed: this machine's CPU" in proc.stdout
        assert {t.params["precision"] for t in study.trials} <= {"32-true", "bf16-mixed"}


@pytest.mark.slow
def test_two_trials_run_at_once_in_processes_of_their_own(tmp_path, tiny_data):
    sweep = tmp_path / "sweep"
    meet = (  # each trial waits for the other before it trains
        "+callbacks.meet._target_=rendezvous.Rendezvous",
        f"+callbacks.meet.folder={tmp_path / 'arrived'}",
        "+callbacks.meet.parties=2",
    )
    proc = run_search(
        tmp_path, sweep, tiny_data, "hydra/launcher=local", "hydra.sweeper.n_jobs=2", *meet
    )
    assert len(list(sweep.glob("*/metrics.json"))) == 2
    assert len(list((tmp_path / "arrived").iterdir())) == 2
    assert len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 2  # one process each
    for job in (0, 1):
        assert f"job {job}, trial {job}: COMPLETE" in proc.stdout  # the sweep's summary


@pytest.mark.slow
def test_ranks_that_ddp_spawn_starts_prune_with_the_configured_pruner(tmp_path, tiny_data):
    # The spawned ranks have no Hydra config: the callback brings the pruner's along.
    run_search(
        tmp_path,
        tmp_path / "sweep",
        tiny_data,
        "hydra.sweeper.n_trials=1",
        "trainer=ddp_cpu",
        "trainer.strategy=ddp_spawn",
        *PRUNE_AT_EPOCH_1,
    )
    db = tmp_path / "logs" / "train" / "optuna" / "cifar_amp.db"
    study = optuna.load_study(study_name="cifar_amp", storage=f"sqlite:///{db}")
    assert [t.state for t in study.trials] == [TrialState.PRUNED]
    assert study.trials[0].user_attrs["pruned_at"] == 1


@pytest.mark.slow
def test_a_job_touches_no_cuda_before_its_devices_are_set():
    """hydra/launcher=local gives each job its GPU through CUDA_VISIBLE_DEVICES, set in the job's
    process once the task is loaded; CUDA reads it once, so nothing imported before may ask."""
    code = """
import torch, torch.cuda
asked = []
real_count, real_nvml = torch._C._cuda_getDeviceCount, torch.cuda._device_count_nvml
torch._C._cuda_getDeviceCount = lambda: asked.append("cuda") or real_count()
torch.cuda._device_count_nvml = lambda *a: asked.append("nvml") or real_nvml(*a)
import importlib, importlib.util
import cifar_amp.cli, cifar_amp.extras.multirun.multirun, cifar_amp.training, cifar_amp.extras.sweeps.pruning  # noqa
if importlib.util.find_spec("cifar_amp.extras.tracking.tracking"):  # the tracking extra, where it is kept
    importlib.import_module("cifar_amp.extras.tracking.tracking")
import hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper.sweeper, hydra_plugins.hydra_submitit_launcher  # noqa
print(asked)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


@pytest.mark.parametrize(
    "argv",
    [
        ["hparams_search=optuna"],
        ["hparams_search=optuna_cpu"],
        ["hydra/launcher=slurm", "trainer.devices=4"],
    ],
)
def test_override_precheck_lets_the_sweep_configs_through(argv):
    from cifar_amp.cli import check_overrides
    from conftest import CONFIGS

    config.register(CONFIGS)
    check_overrides(argv, CONFIGS, "train")  # no SystemExit
