"""Batch-wise augmentation really flips, shifts and cuts out, per image."""

import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from cifar_amp import cli, config, metrics
from cifar_amp.data import augment
from cifar_amp.data.augment import Augment as AugmentConfig
from cifar_amp.errors import UserError
from cifar_amp.training import train
from conftest import CONFIGS, REPO, SHRINK


def translate(x: torch.Tensor, shift: torch.Tensor, pad: int) -> torch.Tensor:
    """The obvious per-image shift, a reference: out[n, :, i, j] = reflect-padded
    x[n, :, pad + i + dy[n], pad + j + dx[n]]."""
    h, w = x.shape[-2:]
    padded = F.pad(x, (pad,) * 4, mode="reflect") if pad else x
    return torch.stack(
        [
            padded[n, :, pad + dy : pad + dy + h, pad + dx : pad + dx + w]
            for n, (dy, dx) in enumerate(shift.tolist())
        ]
    )


def images(n=4, size=8):
    return torch.arange(n * 3 * size * size, dtype=torch.float32).view(n, 3, size, size)


def hwc_draw(n, flip, shift):
    return augment.Draw(
        torch.tensor(flip), torch.tensor(shift), torch.zeros(n, 2, dtype=torch.long)
    )


def test_flip_mirrors_exactly_the_chosen_images():
    x = images().to(torch.uint8)
    hwc = x.permute(0, 2, 3, 1).contiguous()
    d = hwc_draw(4, [True, False, True, False], [[0, 0]] * 4)
    out = augment.flip_translate(hwc, torch.arange(4), d).permute(0, 3, 1, 2)
    assert torch.equal(out[0], x[0].flip(-1)) and torch.equal(out[2], x[2].flip(-1))
    assert torch.equal(out[1], x[1]) and torch.equal(out[3], x[3])


def test_the_reference_shift_moves_each_image_by_its_own_offset():
    x = images()
    out = translate(x, torch.tensor([[0, 0], [1, -2], [-3, 3], [2, 2]]), pad=3)
    assert out[1, 0, 2, 2] == x[1, 0, 3, 0]  # interior pixels move by exactly (dy, dx)
    assert torch.equal(out[0], x[0])


def test_cutout_zeroes_one_square_per_image():
    x = torch.ones(3, 3, 32, 32)
    out = augment.cutout(x, torch.tensor([[16, 16], [0, 0], [31, 10]]), size=8)
    assert (out[0] == 0).sum() == 3 * 8 * 8
    assert (out[0, :, 12:20, 12:20] == 0).all()
    assert (out[1] == 0).sum() == 3 * 4 * 4  # clipped at the corner
    assert (out[2, :, 27:, 6:14] == 0).all() and (out[2] == 0).sum() == 3 * 5 * 8


def test_draws_differ_per_image_and_repeat_per_seed_and_epoch():
    cfg = AugmentConfig(flip=True, translate=4, cutout=8)
    a = augment.draw(1000, epoch=0, seed=1, cfg=cfg, device=torch.device("cpu"))
    b = augment.draw(1000, epoch=0, seed=1, cfg=cfg, device=torch.device("cpu"))
    c = augment.draw(1000, epoch=1, seed=1, cfg=cfg, device=torch.device("cpu"))
    assert torch.equal(a.flip, b.flip) and torch.equal(a.shift, b.shift)
    assert not torch.equal(a.shift, c.shift)
    assert 400 < int(a.flip.sum()) < 600
    assert (
        a.shift.min() == -4 and a.shift.max() == 4 and len(set(map(tuple, a.shift.tolist()))) == 81
    )


def test_loader_augments_training_batches_only_when_asked(tiny_data):
    from cifar_amp.data.cifar import CIFARDataModule

    def first_batch(cfg):
        dm = CIFARDataModule(
            data_dir=str(tiny_data), download=False, batch_size=8, val_split=0.0, augment=cfg
        )
        dm.setup()
        return next(iter(dm.train_dataloader()))

    plain = first_batch(AugmentConfig(flip=False, translate=0, cutout=0))
    on = first_batch(AugmentConfig(flip=True, translate=4, cutout=8))
    assert torch.equal(plain[1], on[1])  # same images, same order
    assert on[0].shape == plain[0].shape and on[0].dtype == torch.float32
    assert not torch.equal(on[0], plain[0])
    assert (on[0] == 0).flatten(1).sum(
        1
    ).min() >= 3 * 4 * 4  # a cutout hole (the mean) in each image


def test_mixup_blends_each_image_with_the_one_before_it_and_so_do_the_targets():
    x, labels = torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 1])
    m = augment.Mix(cutmix=False, share=0.7, box=(0, 0, 0, 0))
    mixed, weights = augment.mix(x.clone(), labels, 3, m)
    assert torch.allclose(mixed, 0.7 * x + 0.3 * x.roll(1, 0))
    assert torch.allclose(weights[1], torch.tensor([0.3, 0.7, 0.0]))  # 0.7 of itself, 0.3 of 0
    assert torch.allclose(weights.sum(1), torch.ones(4))


def test_cutmix_pastes_the_box_and_weighs_the_targets_by_its_area():
    x, labels = torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    m = augment.Mix(cutmix=True, share=0.75, box=(0, 4, 4, 8))  # a quarter of the image
    mixed, weights = augment.mix(x.clone(), labels, 4, m)
    assert torch.equal(mixed[:, :, :4, 4:], x.roll(1, 0)[:, :, :4, 4:])
    assert torch.equal(mixed[:, :, 4:], x[:, :, 4:]) and torch.equal(mixed[:, :, :, :4], x[..., :4])
    assert torch.allclose(weights[2], torch.tensor([0.0, 0.25, 0.75, 0.0]))


def test_mix_draws_repeat_per_seed_epoch_and_rank_and_take_both_kinds_when_both_are_on():
    both = AugmentConfig(mixup_alpha=0.2, cutmix_alpha=1.0)
    a = augment.mix_draws(400, epoch=3, seed=1, rank=0, cfg=both)
    assert a == augment.mix_draws(400, epoch=3, seed=1, rank=0, cfg=both)
    assert a != augment.mix_draws(400, epoch=4, seed=1, rank=0, cfg=both)
    assert a != augment.mix_draws(400, epoch=3, seed=1, rank=1, cfg=both)
    cut = [m for m in a if m.cutmix]
    assert 150 < len(cut) < 250  # even odds
    for m in cut:  # the share is what the (clipped) box leaves of the image
        top, bottom, left, right = m.box
        assert m.share == 1 - (bottom - top) * (right - left) / 32**2
    # Beta(0.2, 0.2) puts most mixup shares near 0 or 1, Beta(1, 1) spreads cutmix's evenly
    near_ends = [min(m.share, 1 - m.share) < 0.1 for m in a if not m.cutmix]
    assert sum(near_ends) > 0.5 * len(near_ends)
    only_mixup = augment.mix_draws(50, 0, 1, 0, AugmentConfig(mixup_alpha=1.0))
    assert not any(m.cutmix for m in only_mixup)


def test_mixed_training_batches_carry_class_weights_and_evaluation_batches_do_not(tiny_data):
    from cifar_amp.data.cifar import CIFARDataModule

    def loaders(mixup):
        augment_cfg = AugmentConfig(mixup_alpha=mixup, cutmix_alpha=mixup)
        dm = CIFARDataModule(
            data_dir=str(tiny_data), download=False, batch_size=8, augment=augment_cfg
        )
        dm.setup()
        return dm.train_dataloader(), dm.val_dataloader()

    (train, val), (plain_train, plain_val) = loaders(1.0), loaders(0.0)
    (x, weights), (px, labels) = next(iter(train)), next(iter(plain_train))
    assert weights.shape == (8, 10) and torch.allclose(weights.sum(1), torch.ones(8))
    assert torch.equal(weights.argmax(1) == labels, weights.max(1).values >= 0.5)
    assert not torch.equal(x, px)
    assert torch.equal(next(iter(val))[1], next(iter(plain_val))[1])  # labels, not weights


def test_a_bad_alpha_is_refused():
    from cifar_amp.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="augment.cutmix_alpha: -1; must be >= 0"):
        AugmentConfig(cutmix_alpha=-1)


def test_a_mixer_mixes_each_batch_as_its_epochs_draws_say():
    mixing = AugmentConfig(mixup_alpha=0.4, cutmix_alpha=1.0)
    mixer = augment.Mixer(mixing, num_classes=5, seed=7)
    draws = augment.mix_draws(6, epoch=2, seed=7, rank=1, cfg=mixing, shape=(24, 40))
    x, labels = torch.rand(4, 3, 24, 40), torch.tensor([0, 1, 2, 4])
    for b in (4, 0, 5):  # any order: a batch's mix is its index's, as after a resume
        mixed, weights = mixer.mix(x.clone(), labels, epoch=2, rank=1, batch=b, batches=6)
        expected = augment.mix(x.clone(), labels, 5, draws[b])
        assert torch.equal(mixed, expected[0]) and torch.equal(weights, expected[1])
    for m in (m for m in draws if m.cutmix):  # a box of a non-square image, within it
        top, bottom, left, right = m.box
        assert 0 <= top <= bottom <= 24 and 0 <= left <= right <= 40
        assert m.share == 1 - (bottom - top) * (right - left) / (24 * 40)
    off = augment.Mixer({"mixup_alpha": 0.0}, num_classes=5, seed=7)  # a config without schema
    assert off.mix(x, labels, 2, 1, 0, 6) == (x, labels)


def test_a_mixer_leaves_evaluation_batches_alone_and_names_a_loader_without_length():
    mixer = augment.Mixer(AugmentConfig(mixup_alpha=1.0), num_classes=3, seed=0)
    batch = (torch.rand(2, 3, 8, 8), torch.tensor([0, 2]))
    evaluating = SimpleNamespace(training=False)
    assert mixer.training_batch(batch, evaluating) is batch
    assert mixer.training_batch(batch, None) is batch
    unsized = SimpleNamespace(training=True, num_training_batches=float("inf"))
    with pytest.raises(UserError, match="needs a training loader with a length"):
        mixer.training_batch(batch, unsized)


@pytest.fixture
def forked(tmp_path, monkeypatch):
    """forked(*overrides) -> a config of configs/ with a user's DataModules: data=noise
    (tests/examples/noise_datamodule.py, which cannot mix) and data=mixing_noise (its
    subclass that mixes through a Mixer, docs/fork.md)."""
    configs = shutil.copytree(CONFIGS, tmp_path / "configs")
    noise = "num_classes: 4\nsize: 64\nbatch_size: 16\n"
    noise_yaml = f"_target_: noise_datamodule.NoiseDataModule\n{noise}"
    (configs / "data" / "noise.yaml").write_text(noise_yaml)
    (configs / "data" / "mixing_noise.yaml").write_text(
        f"_target_: mixing_datamodule.MixingNoiseDataModule\n{noise}"
        "augment:\n  mixup_alpha: 0.0\n  cutmix_alpha: 0.0\n"
    )
    monkeypatch.syspath_prepend(str(REPO / "tests" / "examples"))
    config.register(configs)

    def make(*overrides: str):
        shrink = [o for o in SHRINK if not o.startswith("data.")]
        with initialize_config_dir(str(configs), version_base="1.3"):
            return compose("train", [*shrink, "test=false", *overrides])

    return make


def test_a_users_datamodule_mixes_through_a_mixer(forked, tmp_path):
    losses, heads = {}, {}
    for name, mixing in {"plain": (), "mixed": ("data.augment.cutmix_alpha=1.0",)}.items():
        run = tmp_path / name
        result = train(forked("data=mixing_noise", f"run_dir={run}", *mixing))
        losses[name] = result[metrics.TRAIN_LOSS]
        last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
        heads[name] = last["state_dict"]["net.head.3.weight"]
    # Noise images: mixing two of them leaves the loss near log(4) either way, but not equal.
    assert losses["mixed"] != losses["plain"]
    assert not torch.equal(heads["mixed"], heads["plain"])


def test_a_datamodule_that_cannot_mix_says_so_in_one_line(forked, tmp_path, capsys):
    cannot = "data.augment: NoiseDataModule cannot mix batches (it takes no augment argument)"
    with pytest.raises(SystemExit) as e:  # the command line, before Hydra starts
        argv = ["data=noise", "data.augment.mixup_alpha=0.3"]
        cli.check_overrides(argv, tmp_path / "configs", "train")  # forked's
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and cannot in err
    run = tmp_path / "run"  # `+` adds the key: the build refuses it, before anything is written
    with pytest.raises(UserError) as e:
        train(forked("data=noise", "+data.augment.mixup_alpha=0.3", f"run_dir={run}"))
    assert str(e.value).startswith(cannot) and "\n" not in str(e.value)
    assert not run.exists() or not any(run.iterdir())
