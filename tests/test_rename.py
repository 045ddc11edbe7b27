"""`make rename NAME=<pkg>` (scripts/rename.py) on a copy of the repository: the fork trains one
epoch, evaluates, and reads every checkpoint of tests/ under its new name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cifar_amp import checkpoints
from conftest import REPO

OLD = checkpoints.__name__.split(".")[0]
NEW = "renamed_fork"


def copy_of_repo(dest: Path) -> Path:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    for rel in filter(None, tracked.stdout.decode().split("\0")):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes((REPO / rel).read_bytes())
    return dest


@pytest.mark.slow
def test_a_renamed_fork_trains_evaluates_and_reads_every_checkpoint(tmp_path, tiny_data):
    fork = copy_of_repo(tmp_path / "fork")
    subprocess.run([sys.executable, "scripts/rename.py", NEW], cwd=fork, check=True)
    assert (fork / "src" / NEW).is_dir() and not (fork / "src" / OLD).exists()
    left = [
        str(p.relative_to(fork))
        for p in fork.rglob("*")
        if p.is_file() and p.suffix != ".ckpt" and OLD.encode() in p.read_bytes()
    ]
    assert not left
    # This checkout's package may be on sys.path too (an editable install): hide it, so that
    # only the fork's package and its Hydra plugin are found.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys, pathlib\n"
        f"sys.path[:] = [p for p in sys.path if not (pathlib.Path(p) / {OLD!r}).is_dir()]\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{site}:{fork / 'src'}:{fork / 'tests'}"}
    data = (f"data.data_dir={tiny_data}", "data.download=false", "trainer=cpu", "logger=none")
    tiny = ("model=small_cnn", "model.width=8", "model.hidden=32", "data.batch_size=16")

    def run(*argv: str) -> subprocess.CompletedProcess:
        p = subprocess.run(
            [sys.executable, *argv], cwd=fork, env=env, capture_output=True, text=True
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    run("train.py", "trainer.max_epochs=1", *data, *tiny, f"hydra.run.dir={tmp_path}/run")
    assert (tmp_path / "run" / "metrics.json").is_file()
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    run("eval.py", f"ckpt_path={last}", *data, f"hydra.run.dir={tmp_path}/eval")
    assets = sorted(fork.glob("tests/**/*.ckpt"))
    assert len(assets) >= 3
    for ckpt in assets:
        net = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]["net"]
        assert net["_target_"].startswith(f"{NEW}.")
    # Each asset rebuilds its module in the fork (as eval.py would), in one process; and, not
    # installed under its new name, the fork's pip hints come from its own pyproject.toml.
    script = (
        f"from {NEW}.build import module_from_checkpoint\nfrom {NEW}.checkpoints import Checkpoint\n"
        f"from {NEW}.errors import pip_commands\n"
        f"for path in {[str(a) for a in assets]!r}:\n"
        f"    module = module_from_checkpoint(Checkpoint(path))\n"
        f"    assert type(module.net).__module__.startswith('{NEW}.'), path\n"
        "print(pip_commands())\n"
    )
    hints = run("-c", script).stdout.strip()
    assert "pip install -e '.[trackers]'" in hints and OLD.replace("_", "-") not in hints


def test_rename_removes_the_old_names_egg_info(tmp_path):
    # setuptools' build metadata of an editable install (ignored by git), which the rename
    # carried over to src/<new>.egg-info, still naming the old package.
    from scripts import rename

    (tmp_path / "pyproject.toml").write_text(f'[project]\nname = "{OLD.replace("_", "-")}"\n')
    (tmp_path / "src" / OLD).mkdir(parents=True)
    (tmp_path / "src" / OLD / "__init__.py").write_text("")
    (egg := tmp_path / "src" / f"{OLD}.egg-info").mkdir()
    (egg / "top_level.txt").write_text(f"{OLD}\n")
    assert rename.main([NEW, "--root", str(tmp_path)]) == 0
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == [NEW]
