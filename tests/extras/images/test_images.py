"""data/images.py, the one way image files are read (image folders, predict, export): upright
by their EXIF orientation, RGB, every listed suffix, and the evaluation resize + centre crop."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from cifar_amp.extras.images.images import SUFFIXES, UnreadableImage, decode, eval_resize


def test_a_photo_is_read_as_it_was_held(tmp_path):
    """A camera stores a portrait shot sideways, with an EXIF tag saying how to turn it."""
    stored = Image.new("RGB", (40, 20), (255, 0, 0))
    stored.paste((0, 0, 255), (0, 0, 10, 20))  # the stored image's left quarter is blue
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: turn 90 degrees clockwise to view
    stored.save(tmp_path / "phone.jpg", exif=exif)
    seen = decode(str(tmp_path / "phone.jpg"))
    assert seen.size == (20, 40) and seen.mode == "RGB"  # portrait now
    r, _, b = seen.getpixel((10, 2))
    assert b > 200 and r < 50  # the blue quarter is at the top
    assert seen.getpixel((10, 37))[0] > 200


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_every_listed_suffix_is_read_as_rgb(tmp_path, suffix):
    image = Image.new("RGB", (12, 8), (200, 100, 50))
    (image.convert("L") if suffix == ".pgm" else image).save(tmp_path / f"x{suffix}")
    seen = decode(str(tmp_path / f"x{suffix}"))
    assert seen.mode == "RGB" and seen.size == (12, 8)


def test_an_unreadable_file_is_named_in_one_line(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a PNG")
    with pytest.raises(UnreadableImage, match=r"bad\.png: cannot read this image \("):
        decode(str(tmp_path / "bad.png"))
    # As a DataLoader worker re-raises it: its traceback, then our line; only our line is kept.
    again = UnreadableImage(
        f"Traceback ...\n  ...\n{UnreadableImage.__module__}.UnreadableImage: x.png: why"
    )
    assert str(again) == "x.png: why"


def test_resize_keeps_the_aspect_ratio_and_crops_the_centre():
    img = torch.full((3, 64, 128), 255, dtype=torch.uint8)
    img[:, :, 32:96] = 0  # a dark middle half between bright sides
    out = eval_resize([32, 32])(img)
    assert out.shape == (3, 32, 32)
    assert int(out[:, :, 1:-1].max()) == 0  # stretching would have brought the sides in
