"""Deleting one extra that others need stops `train.py` at once with one line naming them:
`.ci/extras.py --deleted images`. (`make test-extras` runs `--deleted` for every extra, the ones
whose deletion leaves train and eval working among them: CI proves those there, once.)"""

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_deleting_an_extra_that_others_need_names_them_in_one_line():
    names = [n for n in ("images",) if (REPO / "src/cifar_amp/extras" / n).is_dir()]
    if not names:
        pytest.skip("this fork has no images extra")
    run = subprocess.run(
        [sys.executable, ".ci/extras.py", "--deleted", *names],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    said = dict(line.split(": ", 1) for line in run.stdout.splitlines() if line.startswith("ok"))
    refused = said["ok   every extra but images"]  # image_folders and predict need it
    assert "refused it in one line: error: the images extra is deleted" in refused
    assert "image_folders and predict need it" in refused
