"""The data module on tiny CIFAR-format folders written here (same loading code as real data)."""

import pickle
import urllib.error
from types import SimpleNamespace

import pytest
import torch

from cifar_amp.data import cifar
from cifar_amp.data.augment import Augment as AugmentConfig
from cifar_amp.data.cifar import SPECS, CIFARDataModule
from cifar_amp.errors import UserError
from cifar_folder import write_cifar_folder
from conftest import SUBSET


def datamodule(data_dir, **kw) -> CIFARDataModule:
    kw = {"batch_size": 16, "eval_batch_size": 32, **kw}
    dm = CIFARDataModule(data_dir=str(data_dir), download=False, **kw)
    dm.setup()
    return dm


def test_splits_are_decoded_once_seeded_and_disjoint(tiny_data):
    dm = datamodule(tiny_data, val_split=0.25, seed=3)
    (xt, yt), (xv, yv), (_xs, ys) = dm.splits["train"], dm.splits["val"], dm.splits["test"]
    assert xt.dtype == torch.uint8 and xt.shape[1:] == (3, 32, 32) and yt.dtype == torch.int64
    assert len(yv) == 50 and len(yt) == 150 and len(ys) == 60  # 5 x 40 train images, 25% held out
    train_rows = {bytes(x.numpy()) for x in xt}
    assert not any(bytes(x.numpy()) in train_rows for x in xv)
    again = datamodule(tiny_data, val_split=0.25, seed=3)
    assert torch.equal(again.splits["val"][0], xv)
    other = datamodule(tiny_data, val_split=0.25, seed=4)
    assert not torch.equal(other.splits["val"][0], xv)


def test_pixels_follow_cifar_layout(tmp_path):
    root = write_cifar_folder(tmp_path, per_file=4, n_test=4)
    path = root / "cifar-10-batches-py" / "test_batch"
    raw = pickle.loads(path.read_bytes())
    images, labels, key = cifar.read_batch(path, 10)
    assert key == "labels"
    # row = 1024 red, 1024 green, 1024 blue values, each 32 x 32 row-major
    assert images[1, 2, 3, 4] == raw["data"][1][2 * 1024 + 3 * 32 + 4]
    assert labels.tolist() == raw["labels"]


def test_loaders_serve_normalised_batches(tiny_data):
    dm = datamodule(tiny_data, val_split=0.2)
    train = dm.train_dataloader()
    batches = list(train)
    assert len(batches) == len(train) == 160 // 16
    x, y = batches[0]
    assert x.dtype == torch.float32 and x.shape == (16, 3, 32, 32) and y.shape == (16,)
    assert abs(x.mean().item()) < 2.0  # normalised, not 0..255
    test = list(dm.test_dataloader())
    assert sum(len(b[1]) for b in test) == 60  # evaluation keeps the short last batch


def test_training_order_is_a_new_permutation_each_epoch(tiny_data):
    dm = datamodule(
        tiny_data, val_split=0.0, batch_size=25, augment=AugmentConfig(flip=False, translate=0)
    )
    loader = dm.train_dataloader()
    first = torch.cat([y for _, y in loader])
    loader.set_epoch(1)
    second = torch.cat([y for _, y in loader])
    loader.set_epoch(0)
    assert torch.equal(torch.cat([y for _, y in loader]), first)  # a function of (seed, epoch)
    assert not torch.equal(first, second)
    assert torch.equal(first.sort().values, dm.splits["train"][1].sort().values)


def test_ranks_see_disjoint_shards_that_cover_the_data(tiny_data):
    dm = datamodule(tiny_data, val_split=0.0, augment=AugmentConfig(flip=False, translate=0))
    images = dm.splits["train"][0].flatten(1).float()

    def seen(rank, world):
        loader = dm._loader("train")
        loader.rank, loader.world_size, loader.batch_size = rank, world, 1000
        x = torch.cat([b[0] for b in loader]).flatten(1)
        # map normalised images back to dataset rows
        x = x * loader.std.flatten().repeat_interleave(
            1024
        ) + loader.mean.flatten().repeat_interleave(1024)
        return {int(torch.cdist(row[None], images).argmin()) for row in x}

    a, b = seen(0, 2), seen(1, 2)
    assert not a & b and len(a | b) == len(images) and len(a) == len(b)


def test_subset_folder_reads_without_official_checksums():
    if not SUBSET.exists():
        pytest.skip("no ../shared/data/cifar10-subset here")
    dm = datamodule(SUBSET, val_split=0.1)
    assert len(dm.splits["train"][1]) + len(dm.splits["val"][1]) == 4065
    assert len(dm.splits["test"][1]) == 1020


def test_cifar100_folder(tmp_path):
    dm = CIFARDataModule(
        dataset="cifar100", data_dir=str(write_cifar_folder(tmp_path, "cifar100")), download=False
    )
    dm.setup()
    assert dm.num_classes == 100 and int(dm.splits["train"][1].max()) < 100


def test_missing_data_without_download_says_both_ways_out(tmp_path):
    with pytest.raises(UserError) as err:
        CIFARDataModule(data_dir=str(tmp_path), download=False).prepare_data()
    msg = str(err.value)
    assert (
        "data.data_dir" in msg
        and "connect to the internet" in msg
        and SPECS["cifar10"].tv.base_folder in msg
    )


def test_failed_download_says_both_ways_out(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(cifar, "download_and_extract_archive", offline)
    with pytest.raises(UserError) as err:
        CIFARDataModule(data_dir=str(tmp_path), download=True).prepare_data()
    msg = str(err.value)
    assert "download failed" in msg and "data.data_dir" in msg and "connect to the internet" in msg


@pytest.mark.parametrize(
    "damage,expected",
    [
        (lambda f: f.unlink(), "missing data file"),
        (lambda f: f.write_bytes(f.read_bytes()[:1000]), "truncated"),
        (
            lambda f: f.write_bytes(pickle.dumps({"data": [[1, 2, 3]], "labels": [0]})),
            "expected \\(N, 3072\\)",
        ),
        (
            lambda f: f.write_bytes(
                pickle.dumps(
                    {"data": __import__("numpy").zeros((2, 3072), "uint8"), "labels": [0, 10]}
                )
            ),
            "labels span",
        ),
    ],
)
def test_broken_files_are_named(tmp_path, damage, expected):
    root = write_cifar_folder(tmp_path, per_file=4, n_test=4)
    damage(root / "cifar-10-batches-py" / "data_batch_3")
    with pytest.raises(UserError, match=expected) as err:
        datamodule(root)
    assert "data_batch_3" in str(err.value)


def rows(images: torch.Tensor) -> list[bytes]:
    """Each uint8 image's bytes: the tiny folders' images are all different."""
    return [bytes(x.cpu().numpy()) for x in images]


def test_folds_take_turns_validating_stratified_and_leave_the_test_set(tiny_data):
    everything = rows(SPECS["cifar10"].read(tiny_data / "cifar-10-batches-py", "train")[0])
    validated, per_class = [], []
    for fold in range(4):
        dm = datamodule(tiny_data, folds=4, fold=fold, seed=3)
        (xt, _), (xv, yv) = dm.splits["train"], dm.splits["val"]
        assert not set(rows(xt)) & set(rows(xv))
        assert sorted(rows(xt) + rows(xv)) == sorted(everything)
        validated += rows(xv)
        per_class.append(torch.bincount(yv, minlength=10))
    assert sorted(validated) == sorted(everything)  # each training image validates once
    counts = torch.stack(per_class)
    assert (counts.max(0).values - counts.min(0).values).max() <= 1
    plain = datamodule(tiny_data)
    assert torch.equal(dm.splits["test"][0], plain.splits["test"][0])
    other_seed = datamodule(tiny_data, folds=4, fold=3, seed=4)
    assert rows(other_seed.splits["val"][0]) != rows(dm.splits["val"][0])


def test_each_rank_trains_on_a_shard_of_its_folds_training_images(tiny_data):
    still = AugmentConfig(flip=False, translate=0)
    dm = datamodule(tiny_data, folds=4, fold=1, batch_size=1000, augment=still)
    training = set(rows(dm.splits["train"][0]))
    shards = []
    for rank in (0, 1):
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2, overfit_batches=0)
        loader = dm.train_dataloader()
        assert (loader.rank, loader.world_size) == (rank, 2)
        x = torch.cat([b[0] for b in loader]) * loader.std + loader.mean  # back to pixels
        shards.append(set(rows(x.round().to(torch.uint8))))
    assert shards[0] <= training and shards[1] <= training and not shards[0] & shards[1]
    assert len(shards[0] | shards[1]) == len(training) - len(training) % 2
