"""Shared fixtures: a tiny CIFAR folder and a config composed from configs/ and shrunk
(CPU, one small epoch, tiny batches, no logger, a tmp run dir), as the CLI would compose it."""

from __future__ import annotations

import copy
import errno
import functools
import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
from filelock import FileLock
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import compat
from cifar_amp import config, metrics

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
SUBSET = REPO.parent / "shared" / "data" / "cifar10-subset"
ASSETS = REPO / "tests" / "assets"
CIFAR = ("data=cifar10", "data=cifar100")  # checkpoints written by earlier releases

# The curves extra's pictures took half of a tiny run (matplotlib): drawn where a test asks,
# make_cfg(..., pictures=True). `++`: whether or not the extra is there.
PICTURES = ("++callbacks.curves=null", "++callbacks.confusion=null")
SHRINK = (
    "trainer=cpu",
    "trainer.max_epochs=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=none",
    "data.batch_size=16",
    "data.eval_batch_size=32",
    "data.download=false",
    "model=small_cnn",
    "model.width=8",
    "model.hidden=32",
    "module.optimizer.lr=0.05",  # the default 0.2 suits the BatchNorm nets, not small_cnn
    *PICTURES,
)

# pytest-xdist runs one worker per core (addopts): a worker whose torch also used every core
# would share each core with the other workers' threads, slower than one thread each.
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def __getattr__(name: str):
    """`requires_cuda`, `CPU_DDP`: made when a test module imports them. xdist's controller loads
    this file too but runs no test; importing torch here cost it 5 s before any worker started.
    Any other name (pytest looks up `pytest_plugins` on it) is missing, without importing torch."""
    if name not in ("requires_cuda", "CPU_DDP"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    if name == "requires_cuda":
        return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    # Lightning strategy for tests on two CPU processes. Where CUDA exists, this pytest process
    # has already talked to the CUDA driver (torch.cuda.is_available() above, Lightning's device
    # lookup, GPU tests), and a forked child of such a process can crash: on an H100 box both
    # ddp_fork ranks died with SIGSEGV. Spawned ranks start from a fresh interpreter, at the cost
    # of importing torch again (about 20 s per test on a loaded 2-core box), so machines without
    # CUDA, where forking is safe, keep the fast fork. CIFAR_AMP_TEST_SPAWN=1 spawns anyway, to
    # check the CUDA machines' path on a CPU one.
    spawn = torch.cuda.is_available() or os.environ.get("CIFAR_AMP_TEST_SPAWN")
    return "ddp_spawn" if spawn else "ddp_fork"


@functools.cache
def _registered() -> None:
    """config.register, once per process, with the schemas of the extras' entry configs
    (predict, export) that are installed."""
    found = {}
    for name, module, cls in (
        ("predict", "extras.predict.prediction", "PredictConfig"),
        ("export", "extras.predict.export", "ExportConfig"),
    ):
        try:
            found[name] = getattr(importlib.import_module(f"cifar_amp.{module}"), cls)
        except ImportError:
            pass
    config.register(CONFIGS, found)


# Plain strings that differ in every test (its tmp paths): set on the composed config, so the rest
# is composed once per worker. A compose costs about 0.25 s; the suite asks for hundreds.
PER_TEST_KEYS = ("run_dir", "data.data_dir", "ckpt_path", "init_from")


def compose_cfg(
    config_name: str = "train",
    overrides: tuple[str, ...] | list[str] = (),
    return_hydra_config: bool = False,
) -> DictConfig:
    """Hydra's compose(config_name, overrides), as the command composes it. A compose takes a
    third of a second: what tests share is composed once per worker, the config of the
    overrides that choose a group's option, on which a copy takes the overrides of keys (`a=1`,
    `+a=1`, `++a=1`, `~a`) by Hydra's own code, in their order; where that fails, Hydra composes
    the whole, for its own error."""
    per_test = [o for o in overrides if o.partition("=")[0] in PER_TEST_KEYS]
    rest = [o for o in overrides if o not in per_test]
    keys = [] if return_hydra_config else [o for o in rest if _of_a_key(o)]
    choices = tuple(o for o in rest if o not in keys)
    cfg = copy.deepcopy(_compose(config_name, choices, return_hydra_config))
    try:
        compat.apply_key_overrides(cfg, OverridesParser.create().parse_overrides(keys))
    except (HydraException, OmegaConfBaseException):  # Hydra's error, from Hydra's compose
        cfg = copy.deepcopy(_compose(config_name, tuple(rest), return_hydra_config))
    for override in OverridesParser.create().parse_overrides(per_test):
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False)
    return cfg


@functools.cache
def _groups() -> frozenset[str]:
    """Every config group, as an override names it (`model`, `module/optimizer`, ...)."""
    roots = (CONFIGS, *config.EXTRAS.glob("*/configs"))
    return frozenset(
        str(d.relative_to(root)) for root in roots for d in root.rglob("*") if d.is_dir()
    )


@functools.cache
def _of_a_key(override: str) -> bool:
    """Whether `override` is of a config key (`a.b=1`, `+a=1`, `~a.b`), not of a group's option
    (`model=x`, `module/optimizer=sgd`), a sweep or Hydra's own config."""
    try:
        [parsed] = OverridesParser.create().parse_overrides([override])
    except Exception:
        return False
    key = parsed.key_or_group
    of_a_group = ("." not in key and key in _groups()) or parsed.package is not None
    return not (of_a_group or parsed.is_sweep_override() or parsed.is_hydra_override())


@functools.lru_cache(maxsize=None)
def _compose(config_name: str, overrides: tuple[str, ...], return_hydra_config: bool):
    _registered()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose(
            config_name, overrides=list(overrides), return_hydra_config=return_hydra_config
        )


@pytest.fixture(scope="session")
def built_once(tmp_path_factory, worker_id):
    """built_once(name, build) -> a folder that `build(folder)` filled once per pytest run: the
    first worker to ask builds it under a file lock, every worker then reads it (pytest-xdist's
    recipe, on the base temp folder the workers share). Tests read it and write elsewhere."""
    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent

    def get(name: str, build) -> Path:
        folder = root / f"built-once-{name}"
        with FileLock(f"{folder}.lock"):
            if not (folder / ".built").is_file():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                (folder / ".built").touch()
        return folder

    return get


@pytest.fixture(scope="session")
def tiny_data(built_once) -> Path:
    from cifar_folder import write_cifar_folder

    return built_once("cifar", write_cifar_folder)


TOP5 = (  # the command line: top-5 accuracy beside the default accuracy
    "module.metrics.acc_top5._target_=torchmetrics.classification.MulticlassAccuracy",
    "module.metrics.acc_top5.top_k=5",
)
MARKED = ("module._target_=marked_module.Marked", "+module.note=hello")  # tests/examples/


@pytest.fixture(scope="session")
def marked_run(built_once, tiny_data) -> Path:
    """The run dir of one tiny epoch of a fork's own module (tests/examples/marked_module.py,
    with its own argument), with top-5 accuracy and the CSV logger, tested at the end."""

    def make(run_dir: Path) -> None:
        from cifar_amp.training import train

        data = (f"data.data_dir={tiny_data}", f"run_dir={run_dir}", "logger=csv")
        shrink = [o for o in SHRINK if o not in PICTURES]  # the curves extra's test reads them
        train(compose_cfg("train", (*shrink, *data, *MARKED, *TOP5)))

    return built_once("marked-run", make)


# A user's run made small in its data, widths and epochs only (tests/test_user_defaults.py):
# the layer table, the CSV logger, the pictures, the bar and the loader's workers stay on.
USER_SMALL = (
    "trainer=cpu",
    "trainer.max_epochs=1",
    "model=small_cnn",
    "model.width=8",
    "model.hidden=32",
)


@pytest.fixture(scope="session")
def user_run(built_once):
    """user_run(name, make_data, monkeypatch, capsys) -> a folder holding `run/`, the run dir
    of `python train.py <make_data(folder / 'data')> *USER_SMALL`, and `data.txt`, those data
    overrides; trained once per pytest run."""

    def get(name: str, make_data, monkeypatch, capsys) -> Path:
        def train(folder: Path) -> None:
            data = make_data(folder / "data")
            run = f"hydra.run.dir={folder / 'run'}"
            code, err = command(monkeypatch, capsys, "train.py", *data, *USER_SMALL, run)
            assert code == 0, err
            (folder / "data.txt").write_text("\n".join(data))

        return built_once(f"user-run-{name}", train)

    return get


def eval_as_a_user(built: Path, monkeypatch, capsys, run_dir: Path) -> dict:
    """`python eval.py` on the best checkpoint of `user_run`'s run, on its data: metrics.json."""
    ckpt = json.loads((built / "run" / "metrics.json").read_text())[metrics.TESTED_CKPT]
    data = (built / "data.txt").read_text().split("\n")
    args = (*data, "trainer=cpu", f"ckpt_path={ckpt}", f"hydra.run.dir={run_dir}")
    code, err = command(monkeypatch, capsys, "eval.py", *args)
    assert code == 0, err
    return json.loads((run_dir / "metrics.json").read_text())


# tests/examples/own_module.py, a LightningModule of its own, by its config file (docs/fork.md)
OWN = (f"hydra.searchpath=[file://{REPO / 'tests' / 'examples' / 'configs'}]", "module=own")


@pytest.fixture(scope="session")
def own_run(built_once, tiny_data) -> Path:
    """The run dir of one tiny epoch of a module that subclasses LightningModule directly
    (tests/examples/own_module.py), with the CSV logger, tested at the end."""

    def make(run_dir: Path) -> None:
        from cifar_amp.training import train

        data = (f"data.data_dir={tiny_data}", f"run_dir={run_dir}", "logger=csv")
        shrink = [o for o in SHRINK if not o.startswith("module.")]  # the template module's
        train(compose_cfg("train", (*shrink, *data, *OWN)))

    return built_once("own-run", make)


@pytest.fixture
def make_cfg(tmp_path, tiny_data):
    """make_cfg(*overrides, config_name="train", pictures=False) -> the composed config, shrunk
    for tests (`pictures`: with the curves extra's)."""

    def make(*overrides: str, config_name: str = "train", pictures: bool = False):
        shrink = tuple(o for o in SHRINK if not (pictures and o in PICTURES))
        if any(o.startswith("data=") and o not in CIFAR for o in overrides):
            # another DataModule: its own arguments, not the tiny CIFAR folder's
            shrink, data = tuple(o for o in shrink if not o.startswith("data.")), ()
        else:
            data = (f"data.data_dir={tiny_data}",)
        if config_name != "train" or any(
            o.startswith(("model=", "experiment=")) for o in overrides
        ):
            shrink = tuple(o for o in shrink if not o.startswith("model"))  # the caller's
        if config_name != "train" or any(o.startswith("module=") for o in overrides):
            shrink = tuple(o for o in shrink if not o.startswith("module"))  # or the caller's
        return compose_cfg(config_name, (*shrink, *data, f"run_dir={tmp_path}", *overrides))

    return make


@pytest.fixture
def full_disk(monkeypatch):
    """full_disk(name, after=0): every write of a file called `name` after the first `after`
    fails as on a full disk: ENOSPC at the fsync of its temp file (runs.write_atomically syncs
    each file it writes; on some filesystems that is where a full disk shows)."""
    real = os.fsync

    def fill(name: str, after: int = 0) -> None:
        left = [after]

        def fsync(fd: int) -> None:
            if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(f".{name}."):
                if not left[0]:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                left[0] -= 1
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    return fill


class _Touch:
    """Unpickling this creates `path`: a stand-in for code that a checkpoint could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.fixture
def evil_ckpt(tmp_path) -> tuple[Path, Path]:
    """(a checkpoint that would create a file when unpickled, that file): a real small_cnn
    checkpoint's contents plus one object whose unpickling runs code."""
    import torch

    ckpt = torch.load(ASSETS / "release-cd84677-last.ckpt", map_location="cpu", weights_only=True)
    marker = tmp_path / "code-ran"
    torch.save({**ckpt, "note": _Touch(marker)}, tmp_path / "evil.ckpt")
    return tmp_path / "evil.ckpt", marker


def deterministic(result: dict) -> dict:
    """What two runs of the same config must agree on in metrics.json: the core's keys, but
    not its times and paths (an extra's measured keys, such as images/s, are left out too)."""
    keep = set(metrics.BY_NAME.values()) - {metrics.FIT_SECONDS, metrics.TESTED_CKPT}
    return {k: v for k, v in result.items() if k in keep}


def has_extra(name: str) -> bool:
    """Whether the extra `name` is in this copy of the tree (make test-extras deletes them)."""
    return (config.EXTRAS / name).is_dir()


def options(group: str) -> list[str]:
    """The options of a config group, from the files in configs/<group>/ and the extras'."""
    roots = (CONFIGS, *config.EXTRAS.glob("*/configs"))
    return sorted(p.stem for root in roots for p in (root / group).glob("*.yaml"))


def spy(monkeypatch, owner, name: str) -> list:
    """Record what `owner.<name>` returns, at each call, in the list returned."""
    returned, real = [], getattr(owner, name)

    def recording(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(owner, name, recording)
    return returned


def as_trained_by(ckpt: Path, out: Path, module: str, state_dict: dict) -> Path:
    """A copy of checkpoint `ckpt`, at `out`, that says the class `module` trained it (that
    class's `state_dict` in it): a checkpoint of a module that lacks what a command needs."""
    import torch

    data = torch.load(ckpt, map_location="cpu", weights_only=True)
    data["run_settings"]["module._target_"] = module
    torch.save(data | {"state_dict": state_dict}, out)
    return out


def command(monkeypatch, capsys, entry: str, *args: str, cwd=REPO) -> tuple[int, str]:
    """Run `python <entry> <args>` (a script of the repository, or `-m <module>`) in this
    process, from `cwd`, as the command runs it but for the interpreter's start: (its exit
    status, its stderr; an exception that escapes is the interpreter's traceback and exit 1).
    Hydra's global state and the root logger's handlers are put back after."""
    import logging
    import runpy
    import sys
    import traceback

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    module = entry.removeprefix("-m ") if entry.startswith("-m ") else None
    monkeypatch.setattr(sys, "argv", [module or str(REPO / entry), *args])
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(REPO / entry), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        traceback.print_exc()
        code = 1
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)
    return code, capsys.readouterr().err


def deterministic_grads_twice(net) -> list:
    """The first parameter's gradient after each of two identical backward passes of `net` on
    CUDA under torch's deterministic algorithms, where an op without a deterministic kernel
    raises (SpeedNet's max pool did, on one H200)."""
    import torch

    net = net.cuda()
    x = torch.randn(4, 3, 32, 32, device="cuda")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(2):
            net.zero_grad()
            net(x).square().sum().backward()
            grads.append(next(net.parameters()).grad.clone())
    finally:
        torch.use_deterministic_algorithms(was)
    return grads


@pytest.fixture(autouse=True)
def leaves_no_child_process():
    """Every test stops the processes it starts (DataLoader workers, ranks): one left running
    in a reference cycle stopped 5 s into a later test's garbage collection, in that test."""
    import multiprocessing

    yield
    left = multiprocessing.active_children()
    assert not left, f"processes left running by this test: {left}"
