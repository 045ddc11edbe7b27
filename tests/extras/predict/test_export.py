"""python -m cifar_amp.extras.predict.export: ONNX and torch.export files of the evaluation network (EMA
weights where the run averaged them), dynamic in the batch, verified before they are written."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from cifar_amp import build
from cifar_amp.checkpoints import Checkpoint
from cifar_amp.errors import UserError
from cifar_amp.extras.predict import export
from cifar_amp.extras.predict.prediction import Probabilities, data_meta, normaliser, read
from cifar_amp.training import train
from conftest import REPO, SHRINK, SUBSET, as_trained_by, command, compose_cfg, spy

# The export extra's: without it this module skips (collecting it must not fail a test run).
onnxruntime = pytest.importorskip("onnxruntime")


def load(path, **overrides):
    """The checkpoint's module, as predict and export rebuild it, and its data_meta."""
    ckpt = Checkpoint(path)
    return build.module_from_checkpoint(ckpt, **overrides), data_meta(ckpt)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_data) -> Path:
    root = tmp_path_factory.mktemp("run")
    cfg = compose_cfg(
        "train", (*SHRINK, f"data.data_dir={tiny_data}", f"run_dir={root}", "test=false")
    )
    train(cfg)
    return root / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def real_images(tiny_data) -> Path:
    real = SUBSET / "cifar-10-batches-py" / "test_batch"
    return real if real.is_file() else tiny_data / "cifar-10-batches-py" / "test_batch"


def run_export(tmp_path: Path, ckpt: Path, images: Path, *overrides: str) -> Path:
    cfg = compose_cfg(
        "export",
        (
            f"ckpt_path={ckpt}",
            f"input={images}",
            f"run_dir={tmp_path}",
            "verify_images=16",
            *overrides,
        ),
    )
    return Path(export.export(cfg)["output"])


def batches(ckpt: Path, images: Path, *sizes: int) -> list[torch.Tensor]:
    """Normalised real images, in batches of `sizes` (none of them the traced size, 2)."""
    module, meta = load(ckpt)
    x = normaliser(meta)(read(images, meta, module.hparams.num_classes).images)
    return [x[:n] for n in sizes]


@pytest.mark.slow  # an export round trip (torch_export: the default tier)
def test_onnx_runs_in_onnxruntime_at_any_batch_size(ckpt, real_images, tmp_path):
    out = run_export(tmp_path, ckpt, real_images, "format=onnx")
    assert out == tmp_path / "model.onnx" and not list(tmp_path.glob(".*tmp*"))
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a named, dynamic dimension
    module, meta = load(ckpt)
    for x in batches(ckpt, real_images, 1, 5, 37):
        logits = session.run(["logits"], {"images": x.numpy()})[0]
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(logits), module(x), atol=1e-4, rtol=1e-4)
    props = session.get_modelmeta().custom_metadata_map
    assert json.loads(props["class_names"]) == meta["class_names"]
    assert json.loads(props["mean"]) == meta["mean"]


def test_exported_program_runs_at_any_batch_size_with_tta(ckpt, real_images, tmp_path):
    """With flip+shift test-time augmentation built in, as test evaluates the network."""
    out = run_export(tmp_path, ckpt, real_images, "format=torch_export", "tta=flip_shift")
    extra = {"meta.json": ""}
    program = torch.export.load(out, extra_files=extra)
    assert json.loads(extra["meta.json"])["tta"] == "flip_shift"
    module, _ = load(ckpt, tta="flip_shift")
    net, predicting = export.EvalNet(module).eval(), Probabilities(module)
    for x in batches(ckpt, real_images, 1, 5, 37):
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x), net(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(net(x), module.tta(x), atol=0, rtol=0)  # test's logits
            # softmax of them is what predict.py writes
            torch.testing.assert_close(
                net(x).softmax(-1), predicting.predict_step(x, 0), atol=1e-6, rtol=0
            )


def test_a_file_that_fails_verification_is_not_written(ckpt, real_images, tmp_path, monkeypatch):
    real_export = export.to_torch_export

    def perturbed(net, images, path, info):  # an exporter that gets the weights wrong
        with torch.no_grad():
            next(net.parameters()).add_(0.5)
        real_export(net, images, path, info)
        with torch.no_grad():
            next(net.parameters()).sub_(0.5)

    monkeypatch.setattr(export, "to_torch_export", perturbed)
    with pytest.raises(UserError, match="logits differ from PyTorch's .* not written"):
        run_export(tmp_path, ckpt, real_images, "format=torch_export")
    assert not list(tmp_path.glob("*.pt2")) and not list(tmp_path.glob(".*"))


def test_bad_export_requests_are_one_line(ckpt, tmp_path):
    with pytest.raises(
        UserError, match="format=tflite is not an option; valid: onnx, torch_export"
    ):
        run_export(tmp_path, ckpt, tmp_path, "format=tflite")
    with pytest.raises(UserError, match="verified on real images: give input="):
        run_export(tmp_path, ckpt, tmp_path / "nothing", "format=onnx")


def test_export_verifies_on_the_checkpoints_test_images_by_default(
    ckpt, tiny_data, tmp_path, caplog
):
    # The default was data/cifar-10-batches-py/test_batch, whatever the checkpoint's data.
    cfg = compose_cfg("export", (f"ckpt_path={ckpt}", f"run_dir={tmp_path}", "verify_images=8"))
    with caplog.at_level(logging.INFO):
        out = Path(export.export(cfg)["output"])
    test_batch = (tiny_data / "cifar-10-batches-py" / "test_batch").resolve()
    assert f"input={test_batch} at batch sizes 8 and 1" in caplog.text
    meta = onnxruntime.InferenceSession(str(out)).get_modelmeta().custom_metadata_map
    assert "test_images" not in meta and "class_names" in meta  # no path of this machine


def test_export_names_the_checkpoints_test_images_when_they_are_gone(ckpt, tmp_path):
    data = torch.load(ckpt, weights_only=False)
    data["hyper_parameters"]["data_meta"]["test_images"] = str(tmp_path / "gone" / "test_batch")
    moved = tmp_path / "moved.ckpt"
    torch.save(data, moved)
    cfg = compose_cfg("export", (f"ckpt_path={moved}", f"run_dir={tmp_path}"))
    with pytest.raises(UserError) as e:
        export.export(cfg)
    assert str(e.value).startswith(
        f"the checkpoint's test images ({tmp_path / 'gone' / 'test_batch'}): no such file"
    )
    assert "give input=<a folder of images" in str(e.value)


def test_weight_averaged_runs_export_and_predict_the_averaged_weights(
    tiny_data, real_images, tmp_path
):
    """Lightning's EMAWeightAveraging (the speed-run recipe's EMA extends it) saves the averaged
    weights as `state_dict` (the current ones as `current_model_state`); predict and export use
    the averaged ones."""
    cfg = compose_cfg(
        "train",
        [
            *(o for o in SHRINK if not o.startswith("model")),
            f"data.data_dir={tiny_data}",
            f"run_dir={tmp_path / 'run'}",
            "test=false",
            "model=speednet",
            "model.widths=[8,8,8]",
            "+callbacks.ema._target_=lightning.pytorch.callbacks.EMAWeightAveraging",
            "+callbacks.ema.update_starting_at_step=2",
        ],
    )
    train(cfg)
    # The best checkpoint, written mid-fit. (The final last.ckpt is written after the callback
    # copied the averaged weights into the model at train end: it holds them twice.)
    (ckpt,) = (tmp_path / "run" / "checkpoints").glob("best-*.ckpt")
    raw = torch.load(ckpt, map_location="cpu", weights_only=False)
    averaged, current = raw["state_dict"], raw["current_model_state"]
    assert not torch.equal(averaged["net.head.weight"], current["net.head.weight"])
    module, _ = load(ckpt)
    for k, v in module.state_dict().items():
        assert torch.equal(v, averaged[k]), k
    out = run_export(tmp_path / "export", ckpt, real_images, "format=torch_export", "tta=none")
    x = batches(ckpt, real_images, 4)[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.export.load(out).module()(x), module.net(x))


@pytest.mark.slow
def test_export_command(ckpt, real_images, tmp_path):
    out = tmp_path / "shipped" / "net.onnx"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cifar_amp.extras.predict.export",
            f"ckpt_path={ckpt}",
            "format=onnx",
            f"input={real_images}",
            f"output={out}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert f"Exported onnx to {out}" in r.stdout and "max |logit difference|" in r.stdout
    assert out.is_file()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "cifar_amp.extras.predict.export",
            "format=onnx",
            f"hydra.run.dir={tmp_path / 'b'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2
    assert [line for line in bad.stderr.splitlines() if line.startswith("error:")] == [
        "error: ckpt_path is required, e.g. ckpt_path=<run>/checkpoints/best-epoch009.ckpt"
    ]


def test_export_reads_its_checkpoint_as_data_once(real_images, tmp_path, evil_ckpt, monkeypatch):
    from test_checkpoints import project_loads

    path, marker = evil_ckpt
    with pytest.raises(UserError, match=f"ckpt_path={path} holds .*trust_checkpoint=true"):
        run_export(tmp_path / "evil", path, real_images, "format=torch_export")
    assert not marker.exists()
    loads = project_loads(monkeypatch)
    run_export(
        tmp_path / "ok",
        REPO / "tests" / "assets" / "release-cd84677-last.ckpt",
        real_images,
        "format=torch_export",
    )
    assert len(loads) == 1


def test_export_names_what_it_takes_from_the_checkpoint(monkeypatch, capsys):
    # The command: it names itself as typed (`python -m <module>`), not as a script.
    module = export.__name__
    code, err = command(monkeypatch, capsys, f"-m {module}", "ckpt_path=x.ckpt", "model=speednet")
    assert code == 2 and err.count("\n") == 1, err
    assert f"model=speednet: {module} takes the network from the checkpoint" in err


def test_export_builds_the_class_that_trained_the_checkpoint(
    tmp_path, marked_run, real_images, monkeypatch
):
    built = spy(monkeypatch, build, "module_from_checkpoint")
    out = run_export(
        tmp_path, marked_run / "checkpoints" / "last.ckpt", real_images, "format=torch_export"
    )
    assert out.is_file() and type(built[0]).__name__ == "Marked"
    assert built[0].hparams.note == "hello"


@pytest.mark.parametrize("fmt", ["torch_export", "onnx"])
def test_a_lightning_module_of_its_own_exports_its_forward(tmp_path, own_run, real_images, fmt):
    """tests/examples/own_module.py: a LightningModule, not the template's; no TTA of its own."""
    last = own_run / "checkpoints" / "last.ckpt"
    out = run_export(tmp_path, last, real_images, f"format={fmt}")
    module, _ = load(last)
    x = batches(last, real_images, 5)[0]
    with torch.no_grad():
        expected = module(x)
    if fmt == "onnx":
        session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        got = torch.from_numpy(session.run(["logits"], {"images": x.numpy()})[0])
        tta = json.loads(session.get_modelmeta().custom_metadata_map["tta"])
    else:
        extra = {"meta.json": ""}
        got = torch.export.load(out, extra_files=extra).module()(x)
        tta = json.loads(extra["meta.json"])["tta"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert tta == "none"
    with pytest.raises(UserError, match="tta=flip: the export predicts with the module's forward"):
        run_export(tmp_path / "flip", last, real_images, "tta=flip")


def test_an_export_of_a_module_without_forward_of_images_is_one_line(
    tmp_path, own_run, real_images
):
    path = "lightning.pytorch.demos.boring_classes.BoringModel"
    ckpt = as_trained_by(
        own_run / "checkpoints" / "last.ckpt", tmp_path / "m.ckpt", path, BoringModel().state_dict()
    )
    needs = re.escape("the export needs the module's forward(images) -> logits: ")
    with pytest.raises(UserError, match=needs + r".* returned \(1, 3, 32, 2\)"):
        run_export(tmp_path / "out", ckpt, real_images)
    assert not (tmp_path / "out").exists()
