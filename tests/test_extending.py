"""docs/architecture.md's "to add X, edit Y", done on a copy of the repository: a module
hyperparameter is one file, a model two; each trains, and a typo or a bad value is one line.
(A DataModule of your own: tests/test_settings.py; image folders need no file:
tests/extras/image_folders/test_image_folder.py.)"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow
SHRINK = ("trainer=cpu", "trainer.max_epochs=1", "logger=none", "data.batch_size=16")
MLP = """
from torch import nn


class MLP(nn.Module):
    def __init__(self, num_classes: int = 10, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x):
        return self.net(x)
"""


@pytest.fixture
def copy(tmp_path):
    """A copy of the tracked files, committed, so that `changed()` lists what an edit touched."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    dest = tmp_path / "repo"
    for rel in filter(None, files.stdout.decode().split("\0")):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(git + args, cwd=dest, check=True)
    return dest


def changed(repo) -> list[str]:
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    out = subprocess.run(["git", "diff", "--cached", "--name-only"], cwd=repo, capture_output=True)
    return out.stdout.decode().split()


def train(repo, tiny_data, tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": str(repo / "src")}
    argv = [sys.executable, "train.py", *SHRINK, f"data.data_dir={tiny_data}", *overrides]
    argv.append(f"hydra.run.dir={tmp_path / 'runs' / str(len(list(tmp_path.glob('runs/*'))))}")
    return subprocess.run(argv, cwd=repo, capture_output=True, text=True, env=env, timeout=600)


def test_a_module_hyperparameter_is_one_file(copy, tiny_data, tmp_path):
    module = copy / "src" / "cifar_amp" / "module.py"
    text = module.read_text()
    inserted_before = {
        "        label_smoothing: float": "        loss_weight: float = 1.0,  # scales the loss\n",
        "        if not 0 <= label_smoothing": "        if not loss_weight > 0:\n"
        '            raise InvalidArgument("loss_weight", loss_weight, "must be > 0")\n',
    }
    for anchor, lines in inserted_before.items():
        assert text.count(anchor) == 1, anchor
        text = text.replace(anchor, lines + anchor)
    use = "        return loss * self.hparams.loss_weight\n"  # training_step's, the first
    text = text.replace("        return loss\n", use, 1)
    module.write_text(text)
    assert changed(copy) == ["src/cifar_amp/module.py"]
    assert train(copy, tiny_data, tmp_path, "module.loss_weight=0.5").returncode == 0
    typo = train(copy, tiny_data, tmp_path, "module.loss_weigth=0.5")
    assert typo.returncode == 2 and "did you mean module.loss_weight?" in typo.stderr
    bad = train(copy, tiny_data, tmp_path, "module.loss_weight=-1")
    assert bad.returncode == 2
    assert (
        bad.stderr.strip()
        == "error: invalid config value for module.loss_weight: -1.0; must be > 0"
    )


def test_a_model_is_two_files(copy, tiny_data, tmp_path):
    (copy / "src" / "cifar_amp" / "models" / "mlp.py").write_text(MLP.lstrip())
    (copy / "configs" / "model" / "mlp.yaml").write_text(
        textwrap.dedent(
            """\
            defaults:
              - /schema/cifar_amp.models.mlp.MLP@_here_
            hidden: 32
            """
        )
    )
    assert sorted(changed(copy)) == ["configs/model/mlp.yaml", "src/cifar_amp/models/mlp.py"]
    run = train(copy, tiny_data, tmp_path, "model=mlp", "model.hidden=48")
    assert run.returncode == 0, run.stderr[-2000:]
    typo = train(copy, tiny_data, tmp_path, "model=mlp", "model.hiden=48")
    assert typo.returncode == 2 and "did you mean model.hidden?" in typo.stderr
