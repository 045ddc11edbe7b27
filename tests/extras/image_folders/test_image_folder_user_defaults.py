"""Your own images through every entry point as a user types them (tests/test_user_defaults.py
says why): `python train.py data=image_folder data.data_dir=<folder>` with nothing switched off
(the layer table crashed every such run once), then eval.py, predict.py and the export."""

from __future__ import annotations

import json

import pytest
from image_folder import NAMES, write_image_folder

from cifar_amp import metrics
from cifar_folder import write_cifar_folder
from conftest import command, eval_as_a_user

CLASSES = list(NAMES[:3])


def images(root) -> list[str]:
    cifar = write_cifar_folder(root / "cifar", per_file=20)
    files = ("data_batch_1", "data_batch_2")
    return ["data=image_folder", f"data.data_dir={write_image_folder(cifar, root / 'images', files=files)}"]


def test_train_py_and_eval_py_on_an_image_folder_with_a_users_defaults(
    user_run, monkeypatch, capsys, tmp_path
):
    built = user_run("image_folder", images, monkeypatch, capsys)
    run = built / "run"
    result = json.loads((run / "metrics.json").read_text())
    assert result[metrics.EPOCHS] == 1 and result[metrics.VAL_ACC_BEST] is not None
    for made in ("metrics.csv", "history.json", "curves.png", "confusion.png"):
        assert (run / made).is_file(), made
    assert "Total Flops" in (run / "train.log").read_text()  # the layer table, with its FLOPs
    tested = eval_as_a_user(built, monkeypatch, capsys, tmp_path)
    assert tested[metrics.TEST_ACC] == pytest.approx(result[metrics.TEST_ACC])
    assert list(tested[metrics.TEST_ACC_PER_CLASS]) == CLASSES  # by the folder's class names
    assert (tmp_path / "confusion.png").is_file()


def test_predict_py_and_export_on_an_image_folder_run(user_run, monkeypatch, capsys, tmp_path):
    pytest.importorskip("cifar_amp.extras.predict")
    built = user_run("image_folder", images, monkeypatch, capsys)
    ckpt = json.loads((built / "run" / "metrics.json").read_text())[metrics.TESTED_CKPT]
    folder = built / "data" / "images" / CLASSES[2]
    out = tmp_path / "predict"
    code, err = command(
        monkeypatch, capsys, "predict.py", f"ckpt_path={ckpt}", f"input={folder}", f"hydra.run.dir={out}"
    )
    assert code == 0, err
    rows = (out / "predictions.csv").read_text().splitlines()
    assert len(rows) == 1 + len(list(folder.iterdir()))
    assert rows[0].startswith(f"file,label,class,probability,p_{CLASSES[0]}")
    out = tmp_path / "export"
    export = "-m cifar_amp.extras.predict.export"
    code, err = command(
        monkeypatch, capsys, export, f"ckpt_path={ckpt}", "format=torch_export", f"hydra.run.dir={out}"
    )
    assert code == 0, err
    assert (out / "model.pt2").is_file()
