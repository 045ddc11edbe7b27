"""Deleting one extra leaves `train.py` and `eval.py` working, or stops them at once with one
line naming the extras that need it: `.ci/extras.py --deleted` (what `make test-extras` runs for
every extra) on an extra that others need and on one the default run uses."""

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_deleting_one_extra_leaves_train_and_eval_working_or_names_the_extras_that_need_it():
    names = [n for n in ("images", "reliability") if (REPO / "src/cifar_amp/extras" / n).is_dir()]
    if not names:
        pytest.skip("this fork has neither extra")
    run = subprocess.run(
        [sys.executable, ".ci/extras.py", "--deleted", *names],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    said = dict(line.split(": ", 1) for line in run.stdout.splitlines() if line.startswith("ok"))
    if "images" in names:  # image_folders and predict need it
        refused = said["ok   every extra but images"]
        assert "refused it in one line: error: the images extra is deleted" in refused
        assert "image_folders and predict need it" in refused
    if "reliability" in names:
        assert said["ok   every extra but reliability"].startswith("train.py trained")
