"""Extra (docs/fork.md), for the image-folders and predict extras: the one way image files are
read. Pillow decodes, the EXIF orientation is applied (a phone photo is seen as it was held), RGB;
for evaluation the shorter side is resized and the centre cropped, as torchvision's
classification presets do, so that nothing is stretched. Nothing in the core imports this."""

from __future__ import annotations

from PIL import Image, ImageOps
from torchvision.transforms import v2

from cifar_amp.errors import UserError

# torchvision's ImageFolder suffixes, and GIF
SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")


class UnreadableImage(UserError):
    """An image file that cannot be decoded. torch re-raises an exception from a DataLoader
    worker as `type(e)(<the worker's traceback>)`: only its last line, ours, is kept."""

    def __init__(self, message: str) -> None:
        last = message.strip().splitlines()[-1]
        super().__init__(last.removeprefix(f"{__name__}.{type(self).__name__}: "))


def decode(path: str) -> Image.Image:
    """The image at `path`, upright, RGB; UnreadableImage names the file and the cause."""
    try:
        with Image.open(path) as im:
            return ImageOps.exif_transpose(im).convert("RGB")
    except Exception as e:  # Pillow's errors for broken, truncated or foreign files vary
        raise UnreadableImage(f"{path}: cannot read this image ({type(e).__name__}: {e})") from e


def eval_resize(size: tuple[int, int] | list[int]) -> v2.Transform:
    """uint8 image tensor(s) of any size -> `size` [H, W]: the shorter side resized, then centre
    crop. On tensors only: Pillow's resize rounds differently (0.4% of a 61x47 image off by 1)."""
    return v2.Compose([v2.Resize(max(size), antialias=True), v2.CenterCrop(list(size))])


def eval_transform(size: tuple[int, int] | list[int]) -> v2.Transform:
    """A decoded image -> the uint8 [3, H, W] tensor that evaluation sees: in training-time
    evaluation, test and predict alike."""
    return v2.Compose([v2.PILToTensor(), eval_resize(size)])
