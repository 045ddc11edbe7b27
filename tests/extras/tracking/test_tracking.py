"""Trackers: real TensorBoard event files, a real local MLflow store and offline W&B runs,
read back; a resume (new run dir, same run dir, after SIGTERM) continues the tracked run."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from cifar_amp import build, metrics
from cifar_amp.errors import UserError
from cifar_amp.extras.tracking import compat, tracking
from cifar_amp.extras.tracking.tracking import TRACKERS
from cifar_amp.training import train
from conftest import REPO, SHRINK, compose_cfg

pytest.importorskip("tensorboard")


def numeric_results(run_dir: Path) -> dict[str, float]:
    result = json.loads((run_dir / "metrics.json").read_text())
    return {k: v for k, v in result.items() if isinstance(v, (int, float))}


def recorded(run_dir: Path) -> dict:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return ckpt[TRACKERS]


class CrashAt(L.Callback):
    """Dies after optimizer step `step`, once its step checkpoint is written (a kill, an error:
    Lightning marks the tracked run failed)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *_) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


CRASH_AT_14 = (
    f"+callbacks.crash._target_={__name__}.CrashAt",
    "+callbacks.crash.step=14",
    "callbacks.step_checkpoint.every_n_train_steps=2",
)


# -- TensorBoard ---------------------------------------------------------------------------


def test_tensorboard_gets_the_config_curves_and_final_metrics(make_cfg, tmp_path):
    from tensorboard.backend.event_processing import event_file_loader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    train(make_cfg("logger=tensorboard", "trainer.max_epochs=2"))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert len(events.Scalars(metrics.VAL_ACC)) == 2  # one point an epoch
    final = numeric_results(tmp_path)
    for key, value in final.items():
        assert events.Scalars(key)[-1].value == pytest.approx(value), key
    # Each written once (the accumulator would hide a repeat at the same step): fit_seconds by
    # the core's report alone.
    loader = event_file_loader.EventFileLoader
    files = (tmp_path / "tensorboard").glob("events.*")
    tags = [v.tag for f in files for e in loader(str(f)).Load() for v in e.summary.value]
    assert tags.count(metrics.FIT_SECONDS) == 1
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["trainer/max_epochs"].number_value == 2
    assert hparams["run_dir"].string_value == str(tmp_path)
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    outcome = {metrics.TEST_ACC, metrics.TEST_LOSS, metrics.VAL_ACC_BEST, metrics.FIT_SECONDS}
    assert outcome <= {m.name.tag for m in experiment.experiment.metric_infos}


# -- MLflow --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One local SQLite store for the session (creating one takes seconds)."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


@pytest.fixture
def with_mlflow(mlflow_uri, request):
    """Overrides for logger=mlflow in the session's store, in an experiment named after the test."""
    return (
        "logger=mlflow",
        f"logger.mlflow.tracking_uri={mlflow_uri}",
        f"logger.mlflow.experiment_name={request.node.name}",
    )


def mlflow_runs(uri: str, experiment: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


@pytest.mark.slow  # a tracker's store
def test_mlflow_default_store_is_sqlite_in_logs_and_a_set_uri_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = compose_cfg("train", ["logger=mlflow"])
    logger = instantiate(cfg.logger.mlflow, tags=None)
    assert compat.tracking_uri(logger) == f"sqlite:///{tmp_path / 'logs' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    cfg = compose_cfg("train", ["logger=mlflow"])
    assert cfg.logger.mlflow.tracking_uri == "http://tracking.example:5000"
    uri = compose_cfg("train", ["logger=mlflow", "logger.mlflow.tracking_uri=http://h:1"])
    assert uri.logger.mlflow.tracking_uri == "http://h:1"


@pytest.mark.slow  # a tracker's store, two runs
def test_mlflow_run_has_the_config_and_final_metrics_and_resumes_continue_it(
    make_cfg, tmp_path, mlflow_uri, with_mlflow, request
):
    from mlflow import MlflowClient

    first, new = tmp_path / "first", tmp_path / "new"
    train(make_cfg(*with_mlflow, f"run_dir={first}"))
    (run,) = mlflow_runs(mlflow_uri, request.node.name)
    assert run.info.status == "FINISHED"
    config = OmegaConf.to_container(OmegaConf.load(first / "config.yaml"))
    assert run.data.params == tracking.mlflow_params(config)
    assert run.data.params["trainer/max_epochs"] == "1"
    for key, value in numeric_results(first).items():
        assert run.data.metrics[key] == pytest.approx(value), key
    assert recorded(first) == {"mlflow": run.info.run_id}

    # into a new run dir, for one more epoch; then in that run dir again, for a third
    last = first / "checkpoints" / "last.ckpt"
    train(make_cfg(*with_mlflow, f"run_dir={new}", f"ckpt_path={last}", "trainer.max_epochs=2"))
    last = new / "checkpoints" / "last.ckpt"
    train(make_cfg(*with_mlflow, f"run_dir={new}", f"ckpt_path={last}", "trainer.max_epochs=3"))
    (resumed,) = mlflow_runs(mlflow_uri, request.node.name)
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    client = MlflowClient(mlflow_uri)
    val = client.get_metric_history(run.info.run_id, metrics.VAL_ACC)
    assert len(val) == 3  # one point an epoch, over the three parts
    assert resumed.data.params == run.data.params  # MLflow params never change...
    assert resumed.data.tags["resumed/trainer/max_epochs"] == "3"  # ...the resume's are tags
    assert resumed.data.tags["resumed/run_dir"] == str(new)
    for key, value in numeric_results(new).items():
        assert resumed.data.metrics[key] == pytest.approx(value), key


@pytest.mark.slow  # two runs
def test_mlflow_run_continues_after_a_crash(make_cfg, tmp_path, mlflow_uri, with_mlflow, request):
    stopped = tmp_path / "stopped"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(*with_mlflow, *CRASH_AT_14, "trainer.max_epochs=2", f"run_dir={stopped}"))
    (run,) = mlflow_runs(mlflow_uri, request.node.name)
    assert run.info.status == "FAILED"  # Lightning's mark for an interrupted fit
    last = stopped / "checkpoints" / "last.ckpt"
    train(make_cfg(*with_mlflow, "trainer.max_epochs=2", f"run_dir={stopped}", f"ckpt_path={last}"))
    (resumed,) = mlflow_runs(mlflow_uri, request.node.name)
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert resumed.data.metrics[metrics.TEST_ACC] == numeric_results(stopped)[metrics.TEST_ACC]


@pytest.mark.slow  # a tracker's store
def test_a_run_missing_from_the_store_starts_a_new_one(make_cfg, with_mlflow, caplog):
    cfg = make_cfg(*with_mlflow)  # as if the checkpoint was tracked in another store
    logger = build.loggers(cfg, {TRACKERS: {"mlflow": "0" * 32}})["mlflow"]
    assert not logger.continued and logger.run_id != "0" * 32
    uri = cfg.logger.mlflow.tracking_uri
    assert f"MLflow run {'0' * 32} is not in {uri}: a new run starts" in caplog.text


@pytest.mark.slow  # a tracker's store
def test_a_checkpoint_of_the_previous_release_continues_its_run(make_cfg, tmp_path, with_mlflow):
    """Earlier releases kept the tracked runs by logger class name."""
    first = tmp_path / "first"
    train(make_cfg(*with_mlflow, f"run_dir={first}"))
    old = torch.load(first / "checkpoints" / "last.ckpt", weights_only=True)
    run_id = old[TRACKERS]["mlflow"]
    old[TRACKERS] = {"MLFlowLogger": {"run_id": run_id}}
    torch.save(old, tmp_path / "old.ckpt")
    resume = (f"run_dir={tmp_path / 'new'}", f"ckpt_path={tmp_path / 'old.ckpt'}")
    train(make_cfg(*with_mlflow, *resume, "trainer.max_epochs=2"))
    assert recorded(tmp_path / "new") == {"mlflow": run_id}


# -- W&B (offline) -------------------------------------------------------------------------


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the config's offline=true must do it
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return ("logger=wandb",)


def wandb_records(path: Path) -> list:
    """The records of an offline run's log (<run_dir>/wandb/offline-run-*/run-<id>.wandb), in
    order: LevelDB's log format (32 KiB blocks, 7-byte record headers) after W&B's 7-byte header.
    wandb has no Python reader of its own since its core moved to Go."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, part, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + n > len(data):  # still being written
            break
        part, pos = part + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a whole record, or its last piece
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
        elif kind == 0:
            break
    return out


def finished_records(path: Path, timeout: float = 60) -> list:
    """The records once the run's `exit` record is on disk: wandb.finish() returns before
    W&B's core process has flushed an offline run's file."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.2)


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_runs(run_dir: Path) -> list[tuple[str, dict, dict]]:
    """(id, config, final summary) of each W&B run logged in `run_dir`, oldest first."""
    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run_id, config, summary = None, {}, {}
        for r in finished_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
            elif kind == "config":
                config.update({_key(i): json.loads(i.value_json) for i in r.config.update})
            elif kind == "summary":
                summary.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
        out.append((run_id, config, summary))
    return out


@pytest.mark.slow  # a tracker's store, two runs
def test_wandb_runs_offline_with_the_config_and_final_metrics_and_resumes_the_same_id(
    make_cfg, tmp_path, wandb_offline
):
    first, new = tmp_path / "first", tmp_path / "new"
    train(make_cfg(*wandb_offline, f"run_dir={first}"))
    ((run_id, config, summary),) = wandb_runs(first)
    assert recorded(first) == {"wandb": run_id}
    assert config["trainer"]["max_epochs"] == 1 and config["run_dir"] == str(first)
    for key, value in numeric_results(first).items():
        assert summary[key] == pytest.approx(value), key

    last = first / "checkpoints" / "last.ckpt"
    train(make_cfg(*wandb_offline, f"run_dir={new}", f"ckpt_path={last}", "trainer.max_epochs=2"))
    ((resumed_id, _, summary),) = wandb_runs(new)
    assert resumed_id == run_id and summary[metrics.EPOCHS] == 2


@pytest.mark.slow
def test_wandb_same_run_dir_resume_after_a_crash_keeps_the_id(make_cfg, tmp_path, wandb_offline):
    stopped = tmp_path / "stopped"
    common = (*wandb_offline, "trainer.max_epochs=2", f"run_dir={stopped}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(*common, *CRASH_AT_14))
    ((run_id, _, _),) = wandb_runs(stopped)
    train(make_cfg(*common, f"ckpt_path={stopped / 'checkpoints' / 'last.ckpt'}"))
    parts = wandb_runs(stopped)
    assert [p[0] for p in parts] == [run_id, run_id]  # `wandb sync` uploads both into one run
    assert parts[1][2][metrics.EPOCHS] == 2


# -- commands ------------------------------------------------------------------------------


def _cli(*overrides: str, multirun: bool = False) -> list[str]:
    return [sys.executable, "train.py", *(["-m"] if multirun else []), *SHRINK, *overrides]


@pytest.mark.slow
def test_multirun_jobs_are_runs_of_their_own_and_a_resumed_job_continues_its_run(
    tiny_data, tmp_path, mlflow_uri
):
    """`train.py -m` with logger=mlflow: one MLflow run per job; resuming job 1 (into a new run
    dir, as a user would) continues job 1's run. Then `mlflow server` serves the store."""
    common = (
        f"data.data_dir={tiny_data}",
        "logger=mlflow",
        f"logger.mlflow.tracking_uri={mlflow_uri}",
        "logger.mlflow.experiment_name=multirun",
    )
    sweep = tmp_path / "sweep"
    subprocess.run(
        _cli(*common, "seed=0,1", f"hydra.sweep.dir={sweep}", multirun=True),
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    ids = [recorded(sweep / job)["mlflow"] for job in ("0", "1")]
    assert len(set(ids)) == 2
    last = sweep / "1" / "checkpoints" / "last.ckpt"
    subprocess.run(
        _cli(
            *common,
            "seed=1",
            f"ckpt_path={last}",
            "trainer.max_epochs=2",
            f"hydra.run.dir={tmp_path / 'resumed'}",
        ),
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    runs = {r.info.run_id: r for r in mlflow_runs(mlflow_uri, "multirun")}
    assert set(runs) == set(ids)
    assert runs[ids[1]].data.metrics[metrics.EPOCHS] == 2
    assert runs[ids[0]].data.metrics[metrics.EPOCHS] == 1

    # What `mlflow ui --backend-store-uri <store>` shows: the server's REST API over the store.
    port = 5000 + os.getpid() % 1000
    server = subprocess.Popen(
        [
            Path(sys.executable).with_name("mlflow"),
            "server",
            "--backend-store-uri",
            mlflow_uri,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its workers end with it (below)
    )
    try:
        url = f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={ids[1]}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    served = json.load(r)["run"]
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(1)
        served_metrics = {m["key"]: m["value"] for m in served["data"]["metrics"]}
        assert served_metrics[metrics.EPOCHS] == 2
    finally:  # the server and its workers; a loaded machine may take long to stop them
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.mark.slow
def test_loggers_that_start_together_share_a_new_store(tmp_path):
    """The jobs of a parallel sweep (hydra/launcher=local) start their MLflow loggers at once on
    a store that does not exist yet; each one's run lands in it."""
    uri = f"sqlite:///{tmp_path / 'new.db'}"
    code = (
        "from cifar_amp.extras.tracking.tracking import MLFlowLogger; "
        f"MLFlowLogger(experiment_name='together', tracking_uri='{uri}').log_metrics({{'a': 1.0}})"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    jobs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    errors = [p.communicate(timeout=300)[1] for p in jobs]
    assert [p.returncode for p in jobs] == [0, 0, 0], errors
    assert len(mlflow_runs(uri, "together")) == 3


def test_flat_params_are_the_keys_mlflow_logger_logs(monkeypatch):
    """Checked against MLFlowLogger.log_hyperparams itself, with its MLflow client replaced."""
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    from lightning.pytorch.loggers import MLFlowLogger

    logged = {}

    class Client:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def log_batch(self, run_id, params=(), **kwargs) -> None:
            logged.update({p.key: p.value for p in params})

    monkeypatch.setattr(mlflow_tracking, "MlflowClient", Client)
    monkeypatch.setattr(MLFlowLogger, "experiment", property(lambda self: Client()))
    monkeypatch.setattr(MLFlowLogger, "run_id", property(lambda self: "r"))
    params = {"a": {"b": 1, "c": [{"d": 2}], "e": {}}, "f": None, "g": [1, 2]}
    MLFlowLogger(tracking_uri="sqlite:///unused.db").log_hyperparams(params)
    flat = tracking.mlflow_params(params)
    assert flat == logged
    assert set(flat) == {"a/b", "a/c/0/d", "f", "g"}


def test_logger_mlflow_without_mlflow_names_the_trackers_extra_in_one_line(make_cfg, monkeypatch):
    for name in [n for n in sys.modules if n == "mlflow" or n.startswith("mlflow.")] + ["mlflow"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError) as e:
        build.loggers(make_cfg("logger=mlflow"))
    assert str(e.value) == (
        "logger.mlflow needs mlflow, which is not installed here: pip install -e '.[trackers]'"
    )
