"""Your own images through every entry point as a user types them (tests/test_user_defaults.py
says why): `python train.py data=image_folder data.data_dir=<folder>` with nothing switched off
(the layer table crashed every such run once), then eval.py, predict.py and the export, each a
test of its own on the one run."""

from __future__ import annotations

import json

import pytest
from image_folder import NAMES, write_image_folder

from cifar_amp import metrics
from cifar_folder import write_cifar_folder
from conftest import command, eval_as_a_user, has_extra

CLASSES = list(NAMES[:3])


def images(root) -> list[str]:
    cifar = write_cifar_folder(root / "cifar", per_file=20)
    files = ("data_batch_1", "data_batch_2")
    folder = write_image_folder(cifar, root / "images", files=files)
    return ["data=image_folder", f"data.data_dir={folder}"]


@pytest.fixture
def built(user_run, monkeypatch, capsys):
    return user_run("image_folder", images, monkeypatch, capsys)


def best_ckpt(built) -> str:
    return json.loads((built / "run" / "metrics.json").read_text())[metrics.TESTED_CKPT]


def test_train_py_on_an_image_folder_with_a_users_defaults(built):
    run = built / "run"
    result = json.loads((run / "metrics.json").read_text())
    assert result[metrics.EPOCHS] == 1 and result[metrics.VAL_ACC_BEST] is not None
    pictures = ("history.json", "curves.png", "confusion.png") if has_extra("curves") else ()
    for made in ("metrics.csv", *pictures):
        assert (run / made).is_file(), made
    assert "Total Flops" in (run / "train.log").read_text()  # the layer table, with its FLOPs
    assert list(result[metrics.TEST_ACC_PER_CLASS]) == CLASSES


def test_eval_py_on_an_image_folder_run(built, monkeypatch, capsys, tmp_path):
    trained = json.loads((built / "run" / "metrics.json").read_text())
    tested = eval_as_a_user(built, monkeypatch, capsys, tmp_path)
    assert tested[metrics.TEST_ACC] == pytest.approx(trained[metrics.TEST_ACC])
    assert list(tested[metrics.TEST_ACC_PER_CLASS]) == CLASSES  # by the folder's class names
    assert (tmp_path / "confusion.png").is_file() == has_extra("curves")


def test_predict_py_on_an_image_folder_run(built, monkeypatch, capsys, tmp_path):
    pytest.importorskip("cifar_amp.extras.predict")
    folder = built / "data" / "images" / CLASSES[2]
    args = (f"ckpt_path={best_ckpt(built)}", f"input={folder}", f"hydra.run.dir={tmp_path}")
    code, err = command(monkeypatch, capsys, "predict.py", *args)
    assert code == 0, err
    rows = (tmp_path / "predictions.csv").read_text().splitlines()
    assert len(rows) == 1 + len(list(folder.iterdir()))
    assert rows[0].startswith(f"file,label,class,probability,p_{CLASSES[0]}")


def test_export_of_an_image_folder_run(built, monkeypatch, capsys, tmp_path):
    pytest.importorskip("cifar_amp.extras.predict")
    export = "-m cifar_amp.extras.predict.export"
    args = (f"ckpt_path={best_ckpt(built)}", "format=torch_export", f"hydra.run.dir={tmp_path}")
    code, err = command(monkeypatch, capsys, export, *args)
    assert code == 0, err
    assert (tmp_path / "model.pt2").is_file()
