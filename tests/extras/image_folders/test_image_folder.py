"""ImageFolderDataModule: your own images in class folders, through the same training run."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from image_folder import write_image_folder
from PIL import Image

from cifar_amp import build, cli, config, metrics
from cifar_amp.data.augment import Mixing
from cifar_amp.data.cifar import SPECS
from cifar_amp.data.folds import stratified_folds
from cifar_amp.errors import UserError
from cifar_amp.evaluation import evaluate
from cifar_amp.extras.image_folders.image_folder import ImageFolderDataModule
from cifar_amp.module import ImageClassifier
from cifar_amp.training import train
from cifar_folder import write_cifar_folder
from conftest import SHRINK, SUBSET, compose_cfg
from test_resume import EXACT, comparable

CLASSES = ["airplane", "automobile", "bird"]
MIXED = Mixing(mixup_alpha=1.0, cutmix_alpha=1.0)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """3 classes x 40 PNG files in class folders: real CIFAR-10 images from the subset where
    there is one, else the synthetic ones of cifar_folder.py (CI)."""
    tmp = tmp_path_factory.mktemp("images")
    if SUBSET.is_dir():
        source, files = SUBSET, ("data_batch_1",)
    else:
        source, files = write_cifar_folder(tmp, per_file=100), SPECS["cifar10"].files("train")
    return write_image_folder(source, tmp / "folder", per_class=40, files=tuple(files))


@pytest.fixture
def make_folder_cfg(tmp_path, image_folder):
    """Like make_cfg, on `image_folder` (data=image_folder at 32x32, no worker processes)."""

    def make(*overrides: str, config_name: str = "train"):
        picks_model = any(o.startswith(("model=", "experiment=")) for o in overrides)
        drop = ("data.", "model", "module") if config_name != "train" else ("data.",)
        drop += ("model",) if picks_model else ()
        shrink = [o for o in SHRINK if not o.startswith(drop)]
        base = (
            *shrink,
            "data=image_folder",
            f"data.data_dir={image_folder}",
            "data.image_size=32",
            "data.batch_size=16",
            "data.eval_batch_size=32",
            "data.num_workers=0",
            f"run_dir={tmp_path}",
        )
        return compose_cfg(config_name, (*base, *overrides))

    return make


def test_trains_on_an_image_folder_with_workers(make_folder_cfg, tmp_path):
    result = train(make_folder_cfg("data.num_workers=2", "trainer.max_epochs=2"))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved == result
    for key in (metrics.TEST_ACC, metrics.TEST_LOSS, metrics.VAL_ACC_BEST, metrics.EPOCHS):
        assert key in saved
    assert saved[metrics.EPOCHS] == 2
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    best = torch.load(saved["tested_ckpt"], map_location="cpu", weights_only=False)
    assert best["hyper_parameters"]["num_classes"] == 3
    module = ImageClassifier.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert module(torch.zeros(2, 3, 32, 32)).shape == (2, 3)
    # eval.py on the same folder: the best checkpoint's test accuracy again
    eval_cfg = make_folder_cfg(
        f"ckpt_path={saved['tested_ckpt']}", f"run_dir={tmp_path / 'eval'}", config_name="eval"
    )
    assert evaluate(eval_cfg)[metrics.TEST_ACC] == pytest.approx(saved[metrics.TEST_ACC])


def test_split_meta_and_separate_folders(image_folder, tmp_path):
    dm = ImageFolderDataModule(str(image_folder), image_size=40, seed=1)
    assert dm.meta == {
        "class_names": CLASSES,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "image_size": [40, 40],
        "test_images": str(image_folder.resolve()),  # no test_dir: tested on data_dir's
    }
    assert (len(dm.samples["train"]), len(dm.samples["val"])) == (108, 12)
    assert dm.samples["test"] == dm.samples["val"]  # no test_dir: tested on the val images
    again, other = (ImageFolderDataModule(str(image_folder), seed=s) for s in (1, 2))
    assert again.samples == dm.samples and other.samples["val"] != dm.samples["val"]
    val = shutil.copytree(image_folder, tmp_path / "val")
    sep = ImageFolderDataModule(str(image_folder), val_dir=str(val), test_dir=str(val))
    assert len(sep.samples["train"]) == len(sep.samples["val"]) == 120
    shutil.rmtree(val / "bird")
    with pytest.raises(UserError, match=r"val_dir=.* lacks \['bird'\]"):
        ImageFolderDataModule(str(image_folder), val_dir=str(val))


def test_folds_take_turns_validating_and_are_the_cores_folds(image_folder):
    everything = ImageFolderDataModule(str(image_folder)).folder.samples
    labels = torch.tensor([label for _, label in everything])
    core = stratified_folds(labels, 4, seed=1)  # CIFARDataModule's folds of these labels
    validated = []
    for fold in range(4):
        dm = ImageFolderDataModule(str(image_folder), folds=4, fold=fold, seed=1)
        train_set, val = dm.samples["train"], dm.samples["val"]
        assert val == [everything[i] for i in core[fold].tolist()]
        assert sorted(train_set + val) == sorted(everything) and not set(train_set) & set(val)
        assert [label for _, label in val].count(2) == 10  # 40 images a class, 10 a fold
        assert dm.samples["test"] == val  # no test_dir: tested on the validation images
        assert dm.where["val"] == f"fold {fold} of 4 of data.data_dir (stratified, seed 1)"
        validated += val
    assert sorted(validated) == sorted(everything)


def test_folds_with_a_val_dir_or_more_than_a_class_has_are_one_line(make_folder_cfg, tmp_path):
    run_dir = tmp_path / "run"
    val_dir = make_folder_cfg().data.data_dir
    with pytest.raises(UserError) as e:
        train(make_folder_cfg("data.folds=3", "data.fold=0", f"data.val_dir={val_dir}"))
    assert str(e.value) == (
        f"invalid config value for data.folds: 3; not with data.val_dir={val_dir}: folds split "
        "data.data_dir into training and validation images; drop one"
    )
    with pytest.raises(UserError) as e:  # known at once: the files are listed by then
        train(make_folder_cfg("data.folds=41", "data.fold=0", f"run_dir={run_dir}"))
    assert str(e.value).startswith(
        "data.folds=41 is more than the 40 training images of class airplane (the smallest "
    )
    assert not run_dir.exists()


def test_image_size_follows_small_images_and_upsampling_is_named(image_folder, caplog):
    # The default was 224 whatever the images: 32x32 ones trained 13x slower, and less well.
    with caplog.at_level(logging.INFO):
        own = ImageFolderDataModule(str(image_folder))
    assert own.image_size == 32 and own.meta["image_size"] == [32, 32]
    assert "image_size=32, from the images (the 64 sampled are all 32x32)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        asked = ImageFolderDataModule(str(image_folder), image_size=224)
    assert asked.image_size == 224
    assert "image_size=224 upsamples the images 7.0x per side (49x the pixels)" in caplog.text
    assert "data.image_size=32 trains at their size" in caplog.text


def test_images_of_several_sizes_get_224_and_a_note_when_it_upsamples(tmp_path, caplog):
    for i, (cls, side) in enumerate([("a", 48), ("a", 64), ("b", 40), ("b", 48)]):
        (tmp_path / cls).mkdir(exist_ok=True)
        Image.new("RGB", (side + 8, side)).save(tmp_path / cls / f"{i}.png")
    with caplog.at_level(logging.INFO):
        dm = ImageFolderDataModule(str(tmp_path), val_split=0.25)
    assert dm.image_size == 224
    assert "image_size=224 upsamples the images 4.7x per side" in caplog.text
    assert "median shorter side is 48 px (4 sampled)" in caplog.text


def test_predict_sees_a_file_as_training_time_evaluation_saw_it(tmp_path):
    # one image pipeline (data/images.py): same decoder, same resize + crop, on tensors
    prediction = pytest.importorskip(
        "cifar_amp.extras.predict.prediction", reason="the predict extra"
    )
    for i, cls in enumerate("aabb"):
        (tmp_path / cls).mkdir(exist_ok=True)
        Image.effect_noise((61, 47), 60).convert("RGB").save(tmp_path / cls / f"{i}.png")
    dm = ImageFolderDataModule(str(tmp_path), image_size=32, val_split=0.5, num_workers=0)
    dm.setup("fit")
    seen, _ = next(iter(dm.val_dataloader()))
    files = [Path(p) for p, _ in dm.samples["val"]]
    predicted = [prediction.read(f, dm.meta, dm.num_classes).images[0] for f in files]
    assert seen.dtype == torch.uint8 and torch.equal(seen, torch.stack(predicted))


def test_batches_do_not_depend_on_the_number_of_workers(image_folder):
    def first_batches(workers: int):
        dm = ImageFolderDataModule(
            str(image_folder), image_size=24, batch_size=8, num_workers=workers
        )
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(3)
        out = [b for _, b in zip(range(2), loader, strict=False)]
        return [dm.on_after_batch_transfer(b, 0) for b in out]

    a, b = first_batches(0), first_batches(2)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.shape == (8, 3, 24, 24) and xa.dtype == torch.float32
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert -3 < a[0][0].mean() < 3  # normalised on the "device"


def test_channels_last_batches(image_folder):
    dm = ImageFolderDataModule(str(image_folder), image_size=32, batch_size=4, channels_last=True)
    dm.setup("fit")
    x, _ = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert x.is_contiguous(memory_format=torch.channels_last)


MIXING = ("data.augment.mixup_alpha=0.4", "data.augment.cutmix_alpha=1.0")


# Crash after step 7: last.ckpt is that of the end of epoch 0; after step 9: of step 8, mid-epoch 1.
# The default tier resumes mid-epoch with mixing on; the other two cases are slow (CONTRIBUTING.md).
@pytest.mark.parametrize(
    ("crash_step", "saved_at", "mixing"),
    [
        pytest.param(7, (0, 6), (), marks=pytest.mark.slow),
        pytest.param(9, (1, 2), (), marks=pytest.mark.slow),
        (9, (1, 2), MIXING),
    ],
)
def test_resume_matches_uninterrupted_run(make_folder_cfg, tmp_path, crash_step, saved_at, mixing):
    # 108 training images, 16 a batch: 6 steps an epoch; workers draw the first batches of an
    # epoch before Lightning has set it unless the loader defers that (resumable.py). Mixed
    # batches: each batch's mix follows its index in the epoch, on resume too.
    run = ("trainer.max_epochs=2", "data.num_workers=2", *EXACT, *mixing)
    a = tmp_path / "a"
    train(make_folder_cfg(*run, f"run_dir={a}"))
    crashed = tmp_path / "b"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(
            make_folder_cfg(
                *run,
                f"run_dir={crashed}",
                "+callbacks.crash._target_=test_resume.CrashAt",
                f"+callbacks.crash.step={crash_step}",
            )
        )
    last = crashed / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=False)["ImageFolderDataModule"]["train_loader"]
    assert (state["epoch"], state["position"]) == saved_at
    train(make_folder_cfg(*run, f"run_dir={crashed}", f"ckpt_path={last}"))
    ends = [torch.load(r / "checkpoints" / "last.ckpt", weights_only=False) for r in (a, crashed)]
    assert ends[0]["global_step"] == ends[1]["global_step"] == 12
    # The network (not the running training metrics: a resume from an epoch-end checkpoint
    # carries them into the next epoch, with CIFARDataModule too; a module.py matter).
    for key, value in ends[0]["state_dict"].items():
        assert not key.startswith("net.") or torch.equal(value, ends[1]["state_dict"][key]), key
    assert comparable(a) == comparable(crashed)


def test_mixup_and_cutmix_change_training_on_an_image_folder(make_folder_cfg, tmp_path):
    short = ("trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "test=false")
    runs = {
        "plain": (),
        "mixup": ("data.augment.mixup_alpha=1.0",),
        "cutmix": ("data.augment.cutmix_alpha=1.0",),
    }
    losses, heads = {}, {}
    for name, mixing in runs.items():
        result = train(make_folder_cfg(*short, *mixing, f"run_dir={tmp_path / name}"))
        losses[name] = result[metrics.TRAIN_LOSS]
        last = torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)
        heads[name] = last["state_dict"]["net.head.3.weight"]
    for name in ("mixup", "cutmix"):  # soft targets: a higher loss for the same network
        assert losses[name] > losses["plain"], name
        assert not torch.equal(heads[name], heads["plain"]), name


def test_mixed_batches_carry_class_weights_in_training_only(image_folder):
    dm = ImageFolderDataModule(
        str(image_folder), image_size=32, batch_size=8, num_workers=0, augment=MIXED
    )
    loader = dm.train_dataloader()
    batch = next(iter(loader))
    plain_x, labels = dm.on_after_batch_transfer(batch, 0)  # no trainer: as evaluation
    assert labels.shape == (8,)
    dm.trainer = SimpleNamespace(  # the first batch of a training epoch, being transferred
        training=True,
        num_training_batches=len(loader),
        current_epoch=0,
        global_rank=0,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_idx=-1)),
    )
    x, weights = dm.on_after_batch_transfer(batch, 0)
    assert weights.shape == (8, 3) and torch.allclose(weights.sum(1), torch.ones(8))
    assert not torch.equal(x, plain_x)


def test_a_bad_alpha_or_a_cifar_only_option_on_an_image_folder_is_one_line(
    make_folder_cfg, tmp_path, capsys
):
    with pytest.raises(UserError) as e:
        train(make_folder_cfg("data.augment.cutmix_alpha=-1"))
    assert str(e.value) == (
        "invalid config value for data.augment.cutmix_alpha: -1.0; must be >= 0 (0 = off)"
    )
    assert not (tmp_path / "checkpoints").exists()
    config.register(cli.CONFIGS)
    with pytest.raises(SystemExit) as exited:  # translate is CIFAR's: crops are this loader's
        cli.check_overrides(["data=image_folder", "data.augment.translate=2"], cli.CONFIGS, "train")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "data.augment.translate is not a config key" in err
    assert "valid keys of data.augment: cutmix_alpha, mixup_alpha" in err


def _broken(folder, how: str):
    if how == "missing folder":
        return folder / "nowhere", "nowhere: no such folder"
    if how == "no class folders":
        (folder / "x.png").write_bytes(b"")
        return folder, "has no class subfolders"
    if how == "empty class folder":
        (folder / "cat").mkdir()
        return folder, "cat: no image files"
    if how == "one class":
        for name in ("automobile", "bird"):
            shutil.rmtree(folder / name)
        return folder, "one class folder"
    (folder / "bird" / "broken.png").write_bytes(b"not a png")
    return folder, "broken.png: cannot read this image"


@pytest.mark.parametrize(
    "how", ["missing folder", "no class folders", "empty class folder", "one class", "bad image"]
)
def test_bad_folders_are_named_in_one_line(make_folder_cfg, image_folder, tmp_path, how):
    folder = shutil.copytree(image_folder, tmp_path / "data")
    if how == "no class folders":
        folder = tmp_path / "flat"
        folder.mkdir()
    path, expected = _broken(folder, how)
    with pytest.raises(UserError, match=expected) as e:
        train(make_folder_cfg(f"data.data_dir={path}", f"run_dir={tmp_path / 'run'}"))
    assert "\n" not in str(e.value)


def test_a_bad_image_found_by_a_worker_is_named_in_one_line(image_folder, tmp_path):
    folder = shutil.copytree(image_folder, tmp_path / "data")
    (folder / "bird" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    dm = ImageFolderDataModule(str(folder), batch_size=1, num_workers=1, check_images=False)
    with pytest.raises(UserError) as e:  # the file is in one of the two splits
        list(dm.train_dataloader()), list(dm.val_dataloader())
    message = str(e.value)
    # torch's re-raise and `e` hold the loaders' workers in reference cycles through the
    # traceback: broken here, the workers stop with this test, not in a later test's garbage
    # collection, where their shutdown waits out a 5 s timeout.
    traceback.clear_frames(e.tb)
    del e
    assert message.startswith(f"{folder / 'bird' / '0.png'}: cannot read this image")
    assert "\n" not in message and "Traceback" not in message


@pytest.mark.slow  # two ranks: DDP's tests are slow ones
def test_two_ranks_share_each_epoch_without_overlap(make_folder_cfg, tmp_path):
    """DDP on two CPU processes, worker processes under each: EpochSampler shards the epoch."""
    from test_ddp import TWO_RANKS, labels_per_epoch

    cfg = make_folder_cfg(
        *TWO_RANKS, "trainer.max_epochs=2", "data.num_workers=1", "callbacks=none", "test=false"
    )
    dm = build.datamodule(cfg)
    n = len(dm.samples["train"])  # 108: 2 ranks x 54, 3 batches of 16 each (6 dropped)
    dm.samples["train"] = [(path, i) for i, (path, _) in enumerate(dm.samples["train"])]
    orders = []
    for ranks in labels_per_epoch(cfg, dm, n, tmp_path):
        assert len(ranks[0]) == len(ranks[1]) == 48
        assert not set(ranks[0]) & set(ranks[1])
        orders.append(ranks[0])
    assert orders[0] != orders[1]


class _DeathSignal(torch.utils.data.Dataset):
    """Each item: the signal its worker gets when its parent dies (prctl PR_GET_PDEATHSIG)."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        import ctypes

        got = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(got))  # PR_GET_PDEATHSIG
        return got.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_loader_workers_die_with_the_run_and_keep_lightnings_seeding(monkeypatch):
    """A SIGKILLed run leaves no DataLoader worker behind (bench.kill_campaign found them);
    the workers are still seeded as Lightning seeds them."""
    import signal

    from cifar_amp.extras.image_folders.image_folder import WorkerStart

    loader = torch.utils.data.DataLoader(
        _DeathSignal(), num_workers=1, worker_init_fn=WorkerStart(0)
    )
    assert [int(v) for batch in loader for v in batch] == [signal.SIGKILL] * 2
    seeded = []
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    monkeypatch.setattr(
        "cifar_amp.extras.image_folders.image_folder.pl_worker_init_function",
        lambda worker_id, rank: seeded.append((worker_id, rank)),
    )
    monkeypatch.setattr(sys, "platform", "other")  # no prctl on this test's own process
    WorkerStart(3)(0)  # in this process: what a worker runs first
    assert seeded == [(0, 3)]
