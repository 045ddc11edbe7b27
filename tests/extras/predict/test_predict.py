"""predict.py: images of any size and format or a CIFAR batch file in, predictions.csv out;
bad input (unreadable files, empty folders, another data set's checkpoint) in one line."""

from __future__ import annotations

import csv
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from PIL import Image

from cifar_amp import build, cli
from cifar_amp.checkpoints import Checkpoint
from cifar_amp.data.batches import DeviceBatches
from cifar_amp.data.cifar import SPECS, CIFARDataModule
from cifar_amp.errors import UserError
from cifar_amp.extras.predict import prediction
from cifar_amp.extras.predict.meta import describe
from cifar_amp.module import ImageClassifier
from cifar_amp.training import train
from cifar_folder import write_cifar_folder
from conftest import CONFIGS, REPO, SHRINK, SUBSET, as_trained_by, compose_cfg, spy

LEGACY_CKPT = REPO / "tests" / "assets" / "legacy-last.ckpt"
PREDICT = ("trainer=cpu", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")


def train_tiny(root: Path, data_dir: Path, *overrides: str) -> Path:
    """One tiny epoch (small_cnn); the path of its last checkpoint."""
    cfg = compose_cfg(
        "train", (*SHRINK, f"data.data_dir={data_dir}", f"run_dir={root}", "test=false", *overrides)
    )
    train(cfg)
    return root / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_data) -> Path:
    return train_tiny(tmp_path_factory.mktemp("run"), tiny_data)


@pytest.fixture(scope="module")
def test_batch(tiny_data) -> Path:
    """A real CIFAR-10 batch file where the subset is here (with its batches.meta beside it)."""
    real = SUBSET / "cifar-10-batches-py" / "test_batch"
    return real if real.is_file() else tiny_data / "cifar-10-batches-py" / "test_batch"


def cifar_images(batch_file: Path, n: int) -> tuple[np.ndarray, list[int]]:
    with open(batch_file, "rb") as f:
        entry = pickle.load(f, encoding="latin1")
    hwc = np.asarray(entry["data"][:n], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return hwc, list(entry["labels"][:n])


def run_predict(tmp_path: Path, ckpt: Path, input: Path, *overrides: str) -> list[dict]:
    cfg = compose_cfg(
        "predict",
        (*PREDICT, f"ckpt_path={ckpt}", f"input={input}", f"run_dir={tmp_path}", *overrides),
    )
    prediction.predict(cfg)
    return read_csv(tmp_path / "predictions.csv")


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def probabilities(rows: list[dict]) -> torch.Tensor:
    return torch.tensor([[float(v) for k, v in r.items() if k.startswith("p_")] for r in rows])


def test_datamodule_meta_names_classes_and_normalisation(tmp_path):
    root = write_cifar_folder(tmp_path, "cifar100")
    tiny = describe(CIFARDataModule(data_dir=str(root), dataset="cifar100"))
    assert tiny["class_names"][:2] == ["apple", "aquarium_fish"]  # no names file: official
    assert len(tiny["class_names"]) == 100 and tiny["image_size"] == [32, 32]
    assert tiny["mean"] == list(SPECS["cifar100"].mean)
    assert tiny["test_images"] == str((root / "cifar-100-python" / "test").resolve())
    folder = write_cifar_folder(tmp_path / "renamed") / "cifar-10-batches-py"
    names = [f"kind{i}" for i in range(10)]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))
    assert describe(CIFARDataModule(data_dir=str(folder.parent)))["class_names"] == names
    (folder / "batches.meta").write_bytes(b"not a pickle")  # only the names are lost
    assert describe(CIFARDataModule(data_dir=str(folder.parent)))["class_names"][0] == "airplane"


def test_checkpoint_carries_the_datamodule_meta(ckpt, tiny_data, make_cfg, tmp_path):
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["hyper_parameters"]
    assert saved["data_meta"] == describe(CIFARDataModule(data_dir=str(tiny_data)))
    # Without the predict extra's callback a checkpoint has none (predict falls back, below).
    train(make_cfg("~callbacks.data_meta", "test=false", f"run_dir={tmp_path}/run"))
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert "data_meta" not in last["hyper_parameters"]


def test_batch_file_predictions_are_the_tested_networks_own(ckpt, test_batch, tmp_path, capsys):
    """Same normalisation as training: the probabilities are those of the network on the
    batches the DataModule serves in test, and the printed accuracy is test's."""
    rows = run_predict(tmp_path, ckpt, test_batch, "batch_size=64")
    images, labels = cifar_images(test_batch, 10**6)
    assert len(rows) == len(images) and rows[0]["file"] == "test_batch[0]"
    module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu").eval()
    meta = torch.load(ckpt, map_location="cpu", weights_only=False)["hyper_parameters"]["data_meta"]
    x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    mean, std = torch.tensor(meta["mean"]), torch.tensor(meta["std"])
    served = DeviceBatches(x, torch.tensor(labels), 4096, mean, std, train=False)
    with torch.no_grad():
        expected = torch.cat([module(xb).softmax(-1) for xb, _ in served])
    torch.testing.assert_close(probabilities(rows), expected, atol=2e-5, rtol=0)
    names = meta["class_names"]
    assert [r["label"] for r in rows] == [names[y] for y in labels]
    hits = int((expected.argmax(1) == torch.tensor(labels)).sum())
    assert (
        f"accuracy against the input's labels: {hits / len(labels):.1%}" in capsys.readouterr().out
    )


def test_folder_of_png_and_jpeg_of_any_size(ckpt, test_batch, tmp_path):
    images, _ = cifar_images(test_batch, 6)
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    files = []
    for i, img in enumerate(images):
        size = (32, 32) if i < 2 else (40 + 17 * i, 32 + 9 * i)  # (w, h): exact, then larger
        name = ("sub/" if i % 3 == 0 else "") + f"im{i}." + ("png" if i % 2 else "jpg")
        Image.fromarray(img).resize(size).save(folder / name)
        files.append(name)
    (folder / "notes.txt").write_text("not an image: skipped")
    rows = run_predict(tmp_path / "out", ckpt, folder)
    assert sorted(r["file"] for r in rows) == sorted(files)
    names = torch.load(ckpt, weights_only=False)["hyper_parameters"]["data_meta"]["class_names"]
    assert list(rows[0]) == ["file", "label", "class", "probability", *(f"p_{n}" for n in names)]
    p = probabilities(rows)
    torch.testing.assert_close(p.sum(1), torch.ones(len(rows)), atol=1e-4, rtol=0)
    assert [r["class"] for r in rows] == [names[k] for k in p.argmax(1)]
    assert all(r["label"] == "" for r in rows)
    # A lossless 32x32 PNG gives what the batch file gives for the same image.
    batch_rows = run_predict(tmp_path / "batch", ckpt, test_batch)
    png = next(r for r in rows if r["file"] == "im1.png")
    torch.testing.assert_close(
        probabilities([png]), probabilities(batch_rows[1:2]), atol=2e-5, rtol=0
    )


def test_a_single_image_file(ckpt, test_batch, tmp_path, capsys):
    images, _ = cifar_images(test_batch, 1)
    Image.fromarray(images[0]).resize((200, 120)).save(tmp_path / "photo.jpeg")
    rows = run_predict(tmp_path / "out", ckpt, tmp_path / "photo.jpeg")
    assert [r["file"] for r in rows] == ["photo.jpeg"]
    assert f"photo.jpeg: {rows[0]['class']} " in capsys.readouterr().out


def test_unreadable_files_are_listed_and_the_others_predicted(ckpt, test_batch, tmp_path, capsys):
    images, _ = cifar_images(test_batch, 2)
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(images[0]).save(folder / "good.png")
    Image.fromarray(images[1]).resize((64, 64)).save(folder / "full.jpg")
    (folder / "garbage.png").write_bytes(b"this is not a PNG")
    (folder / "cut.jpg").write_bytes((folder / "full.jpg").read_bytes()[:300])  # truncated
    with pytest.raises(UserError, match=r"2 of 4 files could not be read .*cut\.jpg, garbage\.png"):
        run_predict(tmp_path / "out", ckpt, folder)
    assert sorted(r["file"] for r in read_csv(tmp_path / "out" / "predictions.csv")) == [
        "full.jpg",
        "good.png",
    ]
    assert "unreadable, not predicted: garbage.png" in capsys.readouterr().out


def test_nothing_to_predict_is_one_clear_line(ckpt, tiny_data, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no images"):
        run_predict(tmp_path / "a", ckpt, tmp_path / "empty")
    folder = tiny_data / "cifar-10-batches-py"  # batch files, no images: points at one
    with pytest.raises(UserError, match=f"give the file itself, e.g. input={folder}/test_batch"):
        run_predict(tmp_path / "b", ckpt, folder)
    (tmp_path / "only_bad").mkdir()
    (tmp_path / "only_bad" / "x.png").write_bytes(b"no")
    with pytest.raises(UserError, match="none of the 1 images .* could be read: x.png"):
        run_predict(tmp_path / "c", ckpt, tmp_path / "only_bad")
    with pytest.raises(UserError, match="no such file or folder"):
        run_predict(tmp_path / "d", ckpt, tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="neither an image .* nor a CIFAR batch file"):
        run_predict(tmp_path / "e", ckpt, tmp_path / "notes.txt")
    assert not (tmp_path / "a" / "predictions.csv").exists()


def test_another_datasets_checkpoint_is_refused(ckpt, tmp_path):
    c100 = write_cifar_folder(tmp_path / "c100", "cifar100", per_file=20, n_test=20)
    ckpt100 = train_tiny(tmp_path / "run100", c100, "data=cifar100")
    c10_batch = write_cifar_folder(tmp_path / "c10") / "cifar-10-batches-py" / "test_batch"
    with pytest.raises(
        UserError, match=r"labelled for other classes \(10: airplane.*trained on \(100"
    ):
        run_predict(tmp_path / "a", ckpt100, c10_batch)
    with pytest.raises(
        UserError, match=r"labelled for other classes \(100: apple.*trained on \(10"
    ):
        run_predict(tmp_path / "b", ckpt, c100 / "cifar-100-python" / "test")
    # Same number of classes, other names (the batches.meta beside the file says so).
    renamed = tmp_path / "renamed"
    shutil.copytree(c10_batch.parent, renamed)
    (renamed / "batches.meta").write_bytes(pickle.dumps({"label_names": list("abcdefghij")}))
    with pytest.raises(UserError, match=r"labelled for other classes \(10: a, b, c"):
        run_predict(tmp_path / "c", ckpt, renamed / "test_batch")


def test_checkpoints_without_meta(ckpt, test_batch, tmp_path, caplog):
    # Written before data_meta existed (CIFAR-10): its defaults, and a warning that says so.
    rows = run_predict(tmp_path / "legacy", LEGACY_CKPT, test_batch)
    assert list(rows[0])[4:] == [f"p_{n}" for n in SPECS["cifar10"].names]
    assert (
        "has no data_meta (written before it, or without the predict extra's callbacks): "
        "assuming cifar10's" in caplog.text
    )
    # A DataModule of the user's without `meta`: the normalisation is unknown, so refused.
    raw = torch.load(ckpt, map_location="cpu", weights_only=False)
    raw["hyper_parameters"]["data_meta"] = None
    raw["run_settings"]["data.dataset"] = "mine.FolderDataModule"
    raw.pop("CIFARDataModule", None)
    torch.save(raw, tmp_path / "theirs.ckpt")
    with pytest.raises(UserError, match="mine.FolderDataModule, has no `meta`"):
        run_predict(tmp_path / "theirs", tmp_path / "theirs.ckpt", test_batch)
    # Mean/std without class names: classes go by index.
    raw["hyper_parameters"]["data_meta"] = {
        "mean": [0.5] * 3,
        "std": [0.25] * 3,
        "image_size": [32, 32],
    }
    torch.save(raw, tmp_path / "unnamed.ckpt")
    rows = run_predict(tmp_path / "unnamed", tmp_path / "unnamed.ckpt", test_batch)
    assert list(rows[0])[4:] == [f"p_{i}" for i in range(10)]


def test_predictions_use_the_modules_test_time_augmentation(ckpt):
    module = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu", tta="flip").eval()
    x, predicting = torch.randn(5, 3, 32, 32), prediction.Probabilities(module)
    with torch.no_grad():
        p, p_mirror = predicting.predict_step(x, 0), predicting.predict_step(x.flip(-1), 0)
    torch.testing.assert_close(p.sum(1), torch.ones(5))
    torch.testing.assert_close(p, p_mirror)  # flip TTA: a mirrored batch predicts the same
    with torch.no_grad():
        plain = module.net(x).softmax(-1)
    assert not torch.allclose(p, plain, atol=1e-4)  # and it is not the plain network


@pytest.mark.slow
def test_predict_command_exits_2_after_writing_the_readable_ones(ckpt, test_batch, tmp_path):
    images, _ = cifar_images(test_batch, 1)
    folder = tmp_path / "in"
    folder.mkdir()
    Image.fromarray(images[0]).save(folder / "ok.png")
    (folder / "bad.jpg").write_bytes(b"\xff\xd8 broken")
    run = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "predict.py",
            f"ckpt_path={ckpt}",
            f"input={folder}",
            "trainer=cpu",
            f"hydra.run.dir={run}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "bad.jpg" in err[0] and str(run / "predictions.csv") in err[0]
    assert "Predicted 1 image(s)" in r.stdout
    assert [row["file"] for row in read_csv(run / "predictions.csv")] == ["ok.png"]


def test_predict_reads_its_checkpoint_as_data_once(test_batch, tmp_path, evil_ckpt, monkeypatch):
    from test_checkpoints import project_loads

    path, marker = evil_ckpt
    with pytest.raises(UserError, match=f"ckpt_path={path} holds .*trust_checkpoint=true"):
        run_predict(tmp_path / "evil", path, test_batch)
    assert not marker.exists()
    loads = project_loads(monkeypatch)
    run_predict(
        tmp_path / "ok", REPO / "tests" / "assets" / "release-cd84677-last.ckpt", test_batch
    )
    assert len(loads) == 1


@pytest.mark.parametrize(
    "override,expected",
    [
        ("model=small_cnn", "model=small_cnn: predict.py takes the network from the checkpoint"),
        ("data.data_dir=x", "predict.py takes the data's class names, normalisation and image"),
    ],
)
def test_predict_names_what_it_takes_from_the_checkpoint(capsys, override, expected):
    compose_cfg("predict")  # registers predict's schema
    with pytest.raises(SystemExit) as e:
        cli.check_overrides(["ckpt_path=x.ckpt", "input=x", override], CONFIGS, "predict")
    err = capsys.readouterr().err
    assert e.value.code == 2 and expected in err and err.count("\n") == 1
    assert "its keys: batch_size, ckpt_path, input, precision" in err


def test_predict_py_with_the_images_extra_deleted_is_one_line(tmp_path, monkeypatch, capsys):
    # As a fork that deleted src/cifar_amp/extras/images and kept predict (it needs images).
    import runpy

    from cifar_amp import config

    extras = tmp_path / "extras"
    for d in (p for p in config.EXTRAS.iterdir() if (p / "__init__.py").is_file()):
        if d.name != "images":
            (extras / d.name).mkdir(parents=True)
            shutil.copy(d / "__init__.py", extras / d.name)
    monkeypatch.setattr(config, "EXTRAS", extras)
    for name in [m for m in sys.modules if m.startswith("cifar_amp.extras.images.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cifar_amp.extras.images", None)  # its import fails
    for name in [m for m in sys.modules if m.startswith("cifar_amp.extras.predict.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(sys.modules["cifar_amp.extras.predict"], "prediction")  # imported again
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "predict.py"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: the images extra is deleted ({extras / 'images'} is gone), ")
    users = err.partition(" is gone), but ")[2].partition(" need it")[0]
    assert "predict" in users.split(" and ")  # (image_folders too, where it is kept)


def test_predict_builds_the_class_that_trained_the_checkpoint(
    tmp_path, marked_run, test_batch, monkeypatch
):
    built = spy(monkeypatch, build, "module_from_checkpoint")
    rows = run_predict(tmp_path, marked_run / "checkpoints" / "last.ckpt", test_batch)
    assert len(rows) > 0 and type(built[0]).__name__ == "Marked"
    assert built[0].hparams.note == "hello"


def test_a_lightning_module_of_its_own_predicts_by_its_forward(
    tmp_path, own_run, test_batch, capsys
):
    """tests/examples/own_module.py: a LightningModule, not the template's; no TTA of its own."""
    last = own_run / "checkpoints" / "last.ckpt"
    rows = run_predict(tmp_path, last, test_batch, "batch_size=64")
    ckpt = Checkpoint(last)
    module, meta = build.module_from_checkpoint(ckpt), ckpt.hparams["data_meta"]
    images, _ = cifar_images(test_batch, 10**6)
    x = prediction.normaliser(meta)(torch.from_numpy(images).permute(0, 3, 1, 2))
    with torch.no_grad():
        expected = module(x).softmax(-1)
    torch.testing.assert_close(probabilities(rows), expected, atol=2e-5, rtol=0)
    assert "with SmallCNN (10 classes, tta=none, " in capsys.readouterr().out
    said = "tta=flip: predict.py predicts with the module's forward, as OwnClassifier has no test"
    with pytest.raises(UserError, match=said):
        run_predict(tmp_path / "flip", last, test_batch, "tta=flip")
    assert not (tmp_path / "flip").exists()


@pytest.mark.parametrize(
    "module, said",
    [
        (BoringModel, "BoringModel's forward of one 32x32 image returned (1, 3, 32, 2)"),
        (L.LightningModule, "LightningModule's forward of one 32x32 image raised NotImplemented"),
    ],
)
def test_a_module_without_forward_of_images_to_logits_is_one_line(
    tmp_path, own_run, test_batch, module, said
):
    path = f"{module.__module__}.{module.__name__}"
    ckpt = as_trained_by(
        own_run / "checkpoints" / "last.ckpt", tmp_path / "m.ckpt", path, module().state_dict()
    )
    with pytest.raises(UserError) as e:
        run_predict(tmp_path / "out", ckpt, test_batch)
    assert str(e.value).startswith("predict.py needs the module's forward(images) -> logits: ")
    assert said in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
