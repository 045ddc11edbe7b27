"""Extra (docs/fork.md): `confusion.png` in the run dir of every test, train.py's and eval.py's:
the test images' confusion matrix, each row (a true class) in shares of its images, with the
class names of the data. Nothing in the core imports this module."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from lightning.pytorch import Callback
from torch import Tensor

from cifar_amp.lean_module import LeanModule
from cifar_amp.runs import write_atomically
from cifar_amp.seams import class_names

log = logging.getLogger(__name__)
PICTURE = "confusion.png"  # in the run dir


class ConfusionPicture(Callback):
    """Writes `<dirpath>/confusion.png` when a test ends (global rank zero), from the module's
    confusion matrix (a LeanModule counts one in its test)."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_test_end(self, trainer, pl_module) -> None:
        if not (trainer.is_global_zero and isinstance(pl_module, LeanModule)):
            return
        if pl_module.confusion is None:
            return
        if importlib.util.find_spec("matplotlib") is None:  # a machine with the core only
            log.warning(f"{PICTURE} not drawn: matplotlib is not installed")
            return
        names = class_names(trainer.datamodule, len(pl_module.confusion))
        fig = figure(pl_module.confusion, names)
        out = self.dirpath / PICTURE
        # bbox "tight" fits the canvas to the class names: a constrained layout, which measures
        # every name twice, drew CIFAR-100's picture in 0.83 s, against 0.57 (docs/benchmarks.md).
        write_atomically(out, lambda f: fig.savefig(f, format="png", dpi=100, bbox_inches="tight"))


def figure(confusion: Tensor, names: list[str]):
    """A matplotlib figure of `confusion` (rows: true class, columns: predicted)."""
    from matplotlib.figure import Figure  # the object API: no global backend touched

    counts = confusion.double()
    shares = (counts / counts.sum(1, keepdim=True).clamp_min(1)).numpy()
    n = len(names)
    annotated = n <= 20  # each cell's share, where the cells are large enough to read
    # The matrix's side in inches, at 0.45 a class (room for "0.25") or 0.15 (a 7-point name);
    # the names, title and colour bar lie around it, in the picture by bbox "tight" on saving.
    side = min(max((0.45 if annotated else 0.15) * n, 3), 26)
    names_pt = None if annotated else min(7, 0.7 * 72 * side / n)  # smaller than a row
    fig = Figure(figsize=(side * 1.25, side))
    ax = fig.add_axes((0, 0, 0.8, 1))  # square: 0.8 * 1.25 * side wide
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    bar = fig.add_axes((0.84, 0.1, 0.03, 0.8))
    fig.colorbar(image, cax=bar, label="share of the true class's test images")
    ticks = range(n)
    ha = "right" if n <= 10 else "center"
    ax.set_xticks(ticks, names, rotation=90 if n > 10 else 45, ha=ha, fontsize=names_pt)
    ax.set_yticks(ticks, names, fontsize=names_pt)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if annotated:
        for i in range(n):
            for j in range(n):
                colour = "white" if shares[i, j] > 0.5 else "black"
                ax.text(j, i, f"{shares[i, j]:.2f}", ha="center", va="center", color=colour)
    right = counts.diagonal().sum() / counts.sum().clamp_min(1)
    ax.set_title(f"test confusion: {int(counts.sum())} images, {float(right):.1%} right")
    return fig
