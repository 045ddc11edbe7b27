"""Each of the core's data groups through train.py and eval.py as a user types them: nothing
switched off (the layer table, the CSV logger, the pictures, the progress bar), only the data,
the network's widths and the epochs made small (conftest.USER_SMALL). The rest of the suite
shrinks runs further (conftest.SHRINK); these runs keep that honest: a change that breaks a
user's default run fails here. One run per data group, trained by the first test that asks for
it. The image folders', with predict and the export: tests/extras/image_folders/."""

from __future__ import annotations

import json

import pytest

from cifar_amp import metrics
from cifar_amp.data.cifar import SPECS
from cifar_folder import write_cifar_folder
from conftest import eval_as_a_user, has_extra

# The curves extra's pictures and history, where it is in the tree
PICTURES = ("history.json", "curves.png", "confusion.png") if has_extra("curves") else ()


def cifar(group: str):
    def make(root) -> list[str]:
        folder = write_cifar_folder(root, group, per_file=20, n_test=40)
        return [f"data={group}", f"data.data_dir={folder}"]

    return make


@pytest.mark.parametrize("group", ["cifar10", "cifar100"])
def test_train_py_with_a_users_defaults(user_run, monkeypatch, capsys, group):
    run = user_run(group, cifar(group), monkeypatch, capsys) / "run"
    result = json.loads((run / "metrics.json").read_text())
    assert result[metrics.EPOCHS] == 1 and 0 <= result[metrics.TEST_ACC] <= 1
    assert result[metrics.VAL_ACC_BEST] is not None
    for made in ("metrics.csv", "config.yaml", *PICTURES):
        assert (run / made).is_file(), made
    assert "Total Flops" in (run / "train.log").read_text()  # the layer table, with its FLOPs
    assert len(result[metrics.TEST_ACC_PER_CLASS]) == SPECS[group].num_classes


def test_eval_py_with_a_users_defaults(user_run, monkeypatch, capsys, tmp_path):
    built = user_run("cifar10", cifar("cifar10"), monkeypatch, capsys)
    trained = json.loads((built / "run" / "metrics.json").read_text())
    tested = eval_as_a_user(built, monkeypatch, capsys, tmp_path)
    assert tested[metrics.TEST_ACC] == pytest.approx(trained[metrics.TEST_ACC])
    assert tested[metrics.TEST_ACC_PER_CLASS].keys() == trained[metrics.TEST_ACC_PER_CLASS].keys()
    assert list(tested[metrics.TEST_ACC_PER_CLASS])[:2] == ["airplane", "automobile"]
    assert (tmp_path / "confusion.png").is_file() == has_extra("curves")
