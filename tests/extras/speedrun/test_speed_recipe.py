"""The speed recipe's pieces: whitening, alternating flips, TTA, weight averaging, the
and a smoke run of the experiment (the benchmark commands' own tests: bench/tests/)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import DataLoader

from cifar_amp import build, cli, metrics, tta
from cifar_amp.data import augment
from cifar_amp.data.augment import Augment as AugmentConfig
from cifar_amp.data.batches import DeviceBatches
from cifar_amp.errors import UserError
from cifar_amp.extras.speedrun.speedrun import EMA, PatchWhitening, patches
from cifar_amp.module import ImageClassifier
from cifar_amp.training import main, train
from conftest import compose_cfg, requires_cuda
from test_augment import translate as shifted
from test_host_sync import STEPS, _watch, unexplained
from test_resume import assert_same_weights, comparable, resume_mid_epoch
from test_train import assert_eval_reproduces_the_test


def correlated_images(n: int = 64, seed: int = 0) -> torch.Tensor:
    """Images whose neighbouring pixels and channels are strongly correlated, like photos."""
    g = torch.Generator().manual_seed(seed)
    smooth = F.interpolate(torch.randn(n, 1, 8, 8, generator=g), size=16, mode="bilinear")
    return smooth * torch.tensor([1.0, 0.8, 0.5]).view(1, 3, 1, 1) + 0.1 * torch.randn(
        n, 3, 16, 16, generator=g
    )


def test_whitening_layer_whitens_the_patches_it_was_fit_to():
    x = correlated_images()
    before = patches(x, 2, 2)
    assert torch.corrcoef(before.T).abs().min() > 0.3  # the test data really is correlated
    conv = nn.Conv2d(3, 24, kernel_size=2)
    PatchWhitening(eps=1e-8).initialise(conv, x)
    with torch.no_grad():
        out = conv(x)  # pre-activation, (N, 24, 15, 15)
    first = out[:, :12].permute(0, 2, 3, 1).reshape(-1, 12).double()
    torch.testing.assert_close(
        first.mean(0), torch.zeros(12, dtype=torch.double), atol=1e-4, rtol=0
    )
    cov = first.T @ first / len(first)
    torch.testing.assert_close(cov, torch.eye(12, dtype=torch.double), atol=2e-3, rtol=0)
    torch.testing.assert_close(out[:, 12:], -out[:, :12])  # the +/- pairs


def test_whitening_rejects_a_layer_it_cannot_whiten():
    module = ImageClassifier(
        {"_target_": "cifar_amp.models.speednet.SpeedNet", "stem_width": 8, "widths": [8]}, 10
    )
    with pytest.raises(UserError, match="between 12 and 24"):
        PatchWhitening().conv(module)


def flipped_per_epoch(epochs: int, n: int = 40) -> torch.Tensor:
    """(epochs, n) bool: whether image i came out of DeviceBatches mirrored in each epoch."""
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8)
    mean, std = torch.zeros(3), torch.ones(3) / 255  # identity normalisation
    cfg = AugmentConfig(flip=True, alternate_flip=True, translate=0)
    batches = DeviceBatches(
        images, torch.arange(n), 8, mean, std, train=True, augment_cfg=cfg, seed=3
    )
    out = torch.zeros(epochs, n, dtype=torch.bool)
    for e in range(epochs):
        batches.set_epoch(e)
        for x, ids in batches:
            for img, i in zip(x, ids, strict=True):
                plain, mirror = images[i].float(), images[i].float().flip(-1)
                assert torch.equal(img, plain) or torch.equal(img, mirror)
                out[e, i] = torch.equal(img, mirror) and not torch.equal(plain, mirror)
    return out


def test_alternating_flips_alternate_per_image_across_epochs():
    f = flipped_per_epoch(4)
    assert torch.equal(f[1], ~f[0]) and torch.equal(f[2], f[0]) and torch.equal(f[3], ~f[0])
    assert 0 < f[0].sum() < f.shape[1]  # a random half, not all or none


@pytest.mark.parametrize("translate", [0, 2, 4])
def test_fused_flip_translate_matches_flip_then_translate(translate):
    images = torch.randint(0, 256, (30, 3, 32, 32), dtype=torch.uint8)
    d = augment.draw(30, 5, 1, AugmentConfig(translate=translate), torch.device("cpu"))
    idx = torch.randperm(30)[:12]
    dd = d.take(idx)
    x = images[idx]
    expected = shifted(
        torch.where(dd.flip[:, None, None, None], x.flip(-1), x), dd.shift, translate
    )
    got = augment.flip_translate(images.permute(0, 2, 3, 1).contiguous(), idx, dd).permute(
        0, 3, 1, 2
    )
    assert torch.equal(got, expected)


def test_tta_averages_the_views_it_claims():
    torch.manual_seed(0)
    lin = nn.Linear(3 * 8 * 8, 5)
    net = lambda v: lin(v.flatten(1))  # noqa: E731  (not flip- or shift-invariant)
    x = torch.randn(4, 3, 8, 8)
    xp = F.pad(x, (1, 1, 1, 1), mode="reflect")
    a, b = xp[:, :, 0:8, 0:8], xp[:, :, 2:10, 2:10]  # shifted by (-1, -1) and (+1, +1)
    f = lambda v: net(v) + net(v.flip(-1))  # noqa: E731
    torch.testing.assert_close(tta.tta_logits(net, x, "none"), net(x))
    torch.testing.assert_close(tta.tta_logits(net, x, "flip"), f(x) / 2)
    torch.testing.assert_close(
        tta.tta_logits(net, x, "flip_shift", 1), f(x) / 4 + (f(a) + f(b)) / 8
    )


def test_module_tests_with_tta_and_validates_without_unless_asked():
    torch.manual_seed(0)
    kw = dict(
        net={"_target_": "cifar_amp.models.small_cnn.SmallCNN", "width": 4, "hidden": 8},
        num_classes=10,
        tta="flip",
    )
    module = ImageClassifier(**kw).eval()
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    seen = []
    module.forward = lambda v: seen.append(len(v)) or module.net(v)
    with torch.no_grad():
        module.validation_step((x, y), 0)
        module.test_step((x, y), 0)
    assert seen == [6, 12]  # val: one view; test: image + mirror in one batch


def test_ema_callback_of_the_recipe_matches_a_hand_computation(tmp_path):
    cfg = compose_cfg("train", ["experiment=speedrun"])
    start = 2  # the recipe's decay and update rule, starting early enough for a toy run
    ema = instantiate(cfg.callbacks.ema, update_starting_at_step=start)
    decay = cfg.callbacks.ema.decay

    class Toy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)
            self.trace = []

        def training_step(self, batch, i):
            return (self.lin(batch[0]) - batch[1]).pow(2).mean()

        def on_train_batch_end(self, *args):
            self.trace.append([p.detach().clone() for p in self.parameters()])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(8)]
    toy = Toy()
    L.Trainer(
        max_epochs=1,
        callbacks=[ema],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    ).fit(toy, DataLoader(data, batch_size=None))
    expected = None
    for step, weights in enumerate(toy.trace):
        if step < start:
            continue
        expected = (
            weights
            if expected is None
            else [decay * e + (1 - decay) * w for e, w in zip(expected, weights, strict=True)]
        )
    for got, want in zip(
        toy.parameters(), expected, strict=True
    ):  # the average is copied in at train end
        torch.testing.assert_close(got.detach(), want)
    assert not torch.equal(toy.trace[-1][0], expected[0])  # and it is not just the last weights


class ToyBN(L.LightningModule):
    """A net with BatchNorm: float buffers and an integer one (the batch counter)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def training_step(self, batch, i):
        return (self.net(batch[0]) - batch[1]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("use_buffers", [True, False])
def test_ema_keeps_lightnings_averages_and_checkpoint(tmp_path, use_buffers):
    """callbacks.EMA is Lightning's EMAWeightAveraging with another update: same averages,
    same checkpoint keys, so either resumes the other's checkpoints. Saved after fit, ours
    keeps the trained weights as `current_model_state`; Lightning's holds the average twice."""
    kw = dict(decay=0.8, update_starting_at_step=3, use_buffers=use_buffers)
    runs = {}
    for name, cls in (("ours", EMA), ("lightning", L.pytorch.callbacks.EMAWeightAveraging)):
        torch.manual_seed(0)
        data = [(torch.randn(8, 2), torch.randn(8, 1)) for _ in range(10)]
        toy = ToyBN()
        trainer = L.Trainer(
            max_epochs=2,
            callbacks=[cls(**kw)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            default_root_dir=tmp_path,
        )
        trainer.fit(toy, DataLoader(data, batch_size=None))
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
        runs[name] = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
    ours, theirs = runs["ours"], runs["lightning"]
    assert ours["callbacks"].keys() == theirs["callbacks"].keys()
    assert ours["averaging_state"]["n_averaged"] == theirs["averaging_state"]["n_averaged"] > 0
    assert ours["current_model_state"].keys() == theirs["current_model_state"].keys()
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for k, v in ours["state_dict"].items():
        if v.is_floating_point():  # (the batch counter is copied, not averaged)
            torch.testing.assert_close(v, theirs["state_dict"][k], msg=k)
            torch.testing.assert_close(theirs["current_model_state"][k], v, msg=k)
    weights = [k for k in ours["state_dict"] if k.endswith("weight")]
    assert not any(
        torch.equal(ours["current_model_state"][k], ours["state_dict"][k]) for k in weights
    )


# The speed-run recipe, small, with the EMA of the weights running from the second step.
EMA_RECIPE = ("experiment=speedrun", "model.widths=[8,8,8]", "data.batch_size=16")
EMA_RECIPE += ("callbacks.ema.update_starting_at_step=1",)


def test_eval_of_the_tested_checkpoint_gives_the_same_accuracy_with_ema(make_cfg, tmp_path):
    """With EMA too: the final test scores the averaged weights, as eval.py does."""
    assert_eval_reproduces_the_test(make_cfg, tmp_path, *EMA_RECIPE)


class KeepRawWeights(L.Callback):
    """The trained (not averaged) weights at the end of the last epoch."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_ema_runs_last_checkpoint_keeps_the_trained_weights_to_train_on(make_cfg, tmp_path):
    """The final last.ckpt is written after the EMA has put the average into the module; a
    resume that trains longer must still continue from the trained weights."""
    keep = KeepRawWeights()
    cfg = make_cfg(*EMA_RECIPE, "trainer.max_epochs=2", "test=false")
    dm = build.datamodule(cfg)
    module = build.module(cfg, dm.num_classes)
    callbacks = [*build.callbacks(cfg), keep]
    build.trainer(cfg, callbacks=callbacks).fit(module, datamodule=dm)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    raw, averaged = ckpt["current_model_state"], ckpt["state_dict"]
    for k, v in keep.weights.items():
        if k.startswith("net."):
            assert torch.equal(raw[k], v), k
    assert not all(torch.equal(raw[k], averaged[k]) for k in keep.weights if k.startswith("net."))


def test_resume_mid_epoch_with_ema_matches_uninterrupted_run(make_cfg, tmp_path):
    a, b = resume_mid_epoch(functools.partial(make_cfg, *EMA_RECIPE), tmp_path)
    assert_same_weights(a, b)  # the averaged weights, the raw ones and the averaging state
    assert comparable(a) == comparable(b)


def test_speedrun_experiment_trains_and_tests(tiny_data, tmp_path):
    cfg = compose_cfg(
        "train",
        [
            "experiment=speedrun",
            f"data.data_dir={tiny_data}",
            "data.download=false",
            f"run_dir={tmp_path}",
            "logger=none",
            "trainer=cpu",
            "trainer.max_epochs=1",
            "trainer.enable_model_summary=false",
            "model.widths=[8,8,8]",
            "data.batch_size=32",
            "data.eval_batch_size=64",
        ],
    )
    result = train(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved == result and 0.0 <= result[metrics.TEST_ACC] <= 1.0
    ckpt = torch.load(
        tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False
    )
    assert ckpt["hyper_parameters"]["tta"] == "flip_shift"
    stem = ckpt["state_dict"]["net.stem.weight"]
    # Whitened at fit start ([W, -W] pairs) and frozen: training kept the pairs exact.
    assert torch.equal(stem[12:], -stem[:12])


@pytest.mark.parametrize("recipe", ["speedrun", "speedrun_gpu"])
def test_the_speed_recipes_do_not_clip(make_cfg, recipe):
    # As tuned, like the public speed-run scripts they follow.
    assert make_cfg(f"experiment={recipe}").trainer.gradient_clip_val is None


GPU_RECIPE = ("experiment=speedrun_gpu", "model.widths=[8,16,16]", "data.batch_size=32")


def assert_finite_network(ckpt: dict) -> None:
    """The network's weights in `ckpt` (the EMA average) are finite. Not the whole state_dict:
    without validation `val_acc_best` keeps MaxMetric's initial -inf, rightly."""
    net = {k: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}
    assert net and all(v.isfinite().all() for v in net.values() if v.is_floating_point())


def test_speedrun_gpu_recipe_trains_on_cpu_shrunk(make_cfg, tmp_path):
    """The GPU recipe composes and runs anywhere: no validation, last.ckpt (the EMA weights,
    written by a background thread) is tested. (Its timings are the diagnostics extra's.)"""
    result = train(make_cfg(*GPU_RECIPE, "module.compile=false", "trainer.max_epochs=2"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert result["tested_ckpt"] == str(last) and result[metrics.VAL_ACC_BEST] is None
    assert not list(tmp_path.glob("checkpoints/best-*.ckpt"))
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["epoch"] == 1 and result[metrics.EPOCHS] == 2  # written at the end of the last
    assert "current_model_state" in ckpt  # the EMA average is the state_dict
    assert_finite_network(ckpt)
    assert json.loads((tmp_path / "metrics.json").read_text()) == result


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_speedrun_gpu_recipe_trains_compiled_on_a_gpu(make_cfg, tmp_path, mode):
    result = train(
        make_cfg(
            *GPU_RECIPE,
            "trainer=gpu",
            "trainer.max_epochs=2",
            "module.compile=true",  # whatever the recipe's default
            f"module.compile_mode={mode}",
            "callbacks.ema.update_starting_at_step=2",
        )
    )
    assert 0.0 <= result[metrics.TEST_ACC] <= 1.0 and result["epochs"] == 2
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert_finite_network(torch.load(last, map_location="cpu", weights_only=False))


# The EMA updates at every step, so that the window of watched steps sees its updates.
SMALL_SPEEDRUN = (
    "model.widths=[8,8,8]",
    "data.batch_size=16",
    "callbacks.ema.update_starting_at_step=0",
)


@pytest.mark.parametrize(
    "overrides",
    [("experiment=speedrun",), ("experiment=speedrun_gpu", "module.compile=false")],
    ids=["speedrun", "speedrun_gpu"],
)
def test_the_recipes_training_steps_read_nothing_on_the_host(make_cfg, monkeypatch, overrides):
    watch = _watch(make_cfg, monkeypatch, "trainer.max_epochs=1", *overrides, *SMALL_SPEEDRUN)
    bad = unexplained(watch.found)
    assert not bad, "host reads in training steps:\n" + "\n".join(bad)


def test_lightning_ema_reads_the_host_at_each_update(make_cfg, monkeypatch):
    """Why callbacks.EMA exists: Lightning's EMAWeightAveraging (through torch's AveragedModel)
    reads the update count on the host twice per update. If this fails, it no longer does."""
    lightning_ema = "callbacks.ema._target_=lightning.pytorch.callbacks.EMAWeightAveraging"
    watch = _watch(make_cfg, monkeypatch, "experiment=speedrun", lightning_ema, *SMALL_SPEEDRUN)
    bad = unexplained(watch.found)
    assert len(bad) == 2 * STEPS and all("update_parameters" in b for b in bad)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "overrides",
    [
        ("module.compile=false",),
        (),
        ("module.compile_mode=reduce-overhead",),
    ],
    ids=["eager", "compiled", "reduce-overhead"],
)
def test_speedrun_gpu_steps_make_no_cuda_sync(make_cfg, monkeypatch, overrides):
    watch = _watch(
        make_cfg,
        monkeypatch,
        "trainer=gpu",
        "trainer.max_epochs=1",
        "experiment=speedrun_gpu",
        *overrides,
        *SMALL_SPEEDRUN,
        cuda=True,
    )
    bad = unexplained(watch.found)
    assert not bad, "CUDA syncs in training steps:\n" + "\n".join(bad)


def test_the_previous_releases_recipe_checkpoint_resumes_as_data(make_cfg, tmp_path):
    """tests/extras/speedrun/assets/release-369a5b9-speedrun-last.ckpt: experiment=speedrun (widths 8,8,8,
    16-mixed, EMA from step 1, an MLflow run id) written by release 369a5b9 after 2 epochs."""
    path = Path(__file__).parent / "assets" / "release-369a5b9-speedrun-last.ckpt"
    assert not torch.serialization.get_unsafe_globals_in_checkpoint(path)
    result = train(
        make_cfg(
            "experiment=speedrun",
            "model.widths=[8,8,8]",
            "precision=16-mixed",
            "trainer.max_epochs=3",
            "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1",
            f"ckpt_path={path}",
        )
    )
    assert result[metrics.EPOCHS] == 3
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert "current_model_state" in last and last["averaging_state"]


def test_a_gpu_recipe_without_a_gpu_names_itself_and_the_cpu_way(tmp_path, monkeypatch, capsys):
    # It ended in Lightning's "No supported gpu backend found!" / CUDA's "Found no NVIDIA driver".
    # (Other devices and options: tests/extras/guards/test_guards.py, whose slow test runs the
    # command.) No device is visible here, whatever the machine has:
    for name in ("CUDAAccelerator", "MPSAccelerator", "XLAAccelerator"):
        accelerator = getattr(L.pytorch.accelerators, name)
        monkeypatch.setattr(accelerator, "is_available", staticmethod(lambda: False))
    run_dir = tmp_path / "run"
    cfg = compose_cfg("train", ["experiment=speedrun_gpu", f"run_dir={run_dir}"])
    with pytest.raises(SystemExit) as e:
        cli.job(main)(cfg)  # as train.py runs it: a refusal is one line, exit 2
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    # The guards extra names the recipe (tests/extras/guards/test_guards.py); without it, Lightning's refusal.
    assert err.startswith("error: ") and "gpu" in err.lower()
    assert not (run_dir / "config.yaml").exists()
