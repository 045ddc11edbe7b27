"""Batch-wise augmentation really flips, shifts and cuts out, per image."""

import torch
import torch.nn.functional as F

from cifar_amp.config import AugmentConfig
from cifar_amp.data import augment


def images(n=4, size=8):
    return torch.arange(n * 3 * size * size, dtype=torch.float32).view(n, 3, size, size)


def test_flip_mirrors_exactly_the_chosen_images():
    x = images()
    out = augment.hflip(x, torch.tensor([True, False, True, False]))
    assert torch.equal(out[0], x[0].flip(-1)) and torch.equal(out[2], x[2].flip(-1))
    assert torch.equal(out[1], x[1]) and torch.equal(out[3], x[3])


def test_translate_shifts_each_image_by_its_own_offset():
    x = images()
    shift = torch.tensor([[0, 0], [1, -2], [-3, 3], [2, 2]])
    out = augment.translate(x, shift, pad=3)
    padded = F.pad(x, (3, 3, 3, 3), mode="reflect")
    for i, (dy, dx) in enumerate(shift.tolist()):
        assert torch.equal(out[i], padded[i, :, 3 + dy : 3 + dy + 8, 3 + dx : 3 + dx + 8])
    # interior pixels move by exactly (dy, dx)
    assert out[1, 0, 2, 2] == x[1, 0, 3, 0]
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
    assert a.shift.min() == -4 and a.shift.max() == 4 and len(set(map(tuple, a.shift.tolist()))) == 81


def test_alternate_flip_flips_each_image_in_every_other_epoch():
    cfg = AugmentConfig(flip=True, alternate_flip=True, translate=0)
    flips = [augment.draw(500, e, seed=7, cfg=cfg, device=torch.device("cpu")).flip for e in range(4)]
    assert torch.equal(flips[0], ~flips[1]) and torch.equal(flips[0], flips[2]) and torch.equal(flips[1], flips[3])


def test_apply_keeps_shape_and_dtype_and_turns_off_cleanly():
    x = torch.randn(6, 3, 32, 32)
    on = AugmentConfig(flip=True, translate=4, cutout=8)
    d = augment.draw(6, 0, 0, on, torch.device("cpu"))
    out = augment.apply(x, d, on)
    assert out.shape == x.shape and out.dtype == x.dtype and not torch.equal(out, x)
    off = AugmentConfig(flip=False, translate=0, cutout=0)
    assert torch.equal(augment.apply(x, augment.draw(6, 0, 0, off, torch.device("cpu")), off), x)
