"""Extra (docs/fork.md): every run's `history.json` and `curves.png`, whatever the logger;
`python -m cifar_amp.extras.curves.plot <run dir>... [-o curves.png]` overlays runs (a multirun dir: its
jobs). Nothing in the core imports this module."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from cifar_amp import metrics
from cifar_amp.errors import UserError, reported
from cifar_amp.runs import write_atomically, write_text

log = logging.getLogger(__name__)

HISTORY = "history.json"  # in the run dir
LR = "lr"  # key of the learning-rate series in history.json: [[epoch (fractional), lr], ...]
EPOCHS = "epochs"  # key of the per-epoch rows: [{"epoch": 0, "step": N, "train/loss": ...}]
TRAIN = (metrics.TRAIN_LOSS, metrics.TRAIN_ACC)
VAL = (metrics.VAL_LOSS, metrics.VAL_ACC)
PANELS = tuple(zip(("loss", "accuracy"), TRAIN, VAL, strict=True))  # (name, train key, val key)


class TrainingCurves(Callback):
    """Writes `<dirpath>/history.json` at every epoch end and `<dirpath>/curves.png` at fit end
    (global rank zero): train/val loss and accuracy per epoch, and the learning rate of the
    first parameter group, sampled about `lr_points_per_epoch` times an epoch."""

    def __init__(self, dirpath: str, lr_points_per_epoch: int = 20) -> None:
        self.dirpath = Path(dirpath)
        self.lr_points_per_epoch = lr_points_per_epoch
        self.history: dict[str, list] = {EPOCHS: [], LR: []}  # travels in checkpoints
        self._val: dict[str, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        n = trainer.num_training_batches
        if not trainer.optimizers or not n or n == float("inf"):
            return
        every = max(1, int(n) // self.lr_points_per_epoch)
        if batch_idx % every == 0:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            self.history[LR].append([trainer.current_epoch + batch_idx / n, float(lr)])

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._val = self._values(trainer, VAL)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        row = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        row |= self._values(trainer, TRAIN) | self._val
        self._val = {}
        rows = self.history[EPOCHS]
        rows[:] = [r for r in rows if r["epoch"] < row["epoch"]] + [row]
        if trainer.is_global_zero:  # replaced whole (a full disk: one line, the old file kept)
            write_text(self.dirpath / HISTORY, json.dumps(self.history) + "\n")

    def on_fit_end(self, trainer, pl_module) -> None:
        if not (trainer.is_global_zero and self.history[EPOCHS]):
            return
        if importlib.util.find_spec("matplotlib") is None:  # a machine with the core only
            log.warning("curves.png not drawn: matplotlib is not installed (history.json is)")
            return
        write({self.dirpath.name: self.history}, self.dirpath / "curves.png", str(self.dirpath))

    @staticmethod
    def _values(trainer, keys) -> dict[str, float]:
        found = trainer.callback_metrics
        return {k: float(found[k]) for k in keys if k in found}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = state_dict["history"]


def figure(runs: dict[str, dict], title: str | None = None):
    """A matplotlib figure of `runs` (label -> history): loss, accuracy (train dashed, val
    solid) and learning rate, each against epochs."""
    # The object API, not pyplot: no global backend or figure registry is touched (a notebook
    # that imports this keeps its own), and files need no display.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    for i, (label, history) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        rows = history.get(EPOCHS, [])
        for ax, (name, train_key, val_key) in zip(axes[:2], PANELS, strict=True):
            for key, style in ((train_key, "--"), (val_key, "-")):
                points = [(r["epoch"] + 1, r[key]) for r in rows if r.get(key) is not None]
                if points:
                    xs, ys = zip(*points, strict=True)
                    # One legend entry per run (colour); dashed/solid is in the title.
                    shown = (label if key == val_key else None) if len(runs) > 1 else key
                    marker = "." if len(xs) < 30 else None
                    ax.plot(xs, ys, style, color=colour, marker=marker, label=shown)
            ax.set_title(f"{name} (dashed: train, solid: val)")
        if history.get(LR):
            xs, ys = zip(*history[LR], strict=True)
            axes[2].plot(xs, ys, color=colour, label=label if len(runs) > 1 else None)
    axes[2].set_title("learning rate")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def write(runs: dict[str, dict], out: Path, title: str | None = None) -> None:
    fig = figure(runs, title)
    write_atomically(out, lambda f: fig.savefig(f, format=out.suffix[1:] or None, dpi=100))


def load(paths: list[str]) -> dict[str, dict]:
    """label -> history for each run dir (a dir without history.json: its jobs' dirs)."""
    runs: dict[str, dict] = {}
    for arg in paths:
        root = Path(arg)
        if not root.is_dir():
            raise UserError(f"{arg}: no such directory (give run dirs, e.g. logs/train/runs/<run>)")
        found = [root / HISTORY]
        if not found[0].is_file():  # its jobs' dirs, in number order
            found = sorted(
                root.glob(f"*/{HISTORY}"),
                key=lambda p: (not p.parent.name.isdigit(), p.parent.name.zfill(9)),
            )
        if not found:
            raise UserError(
                f"{arg}: no {HISTORY} here or in its subfolders (a run dir of this template "
                "writes one at each epoch end)"
            )
        for path in found:
            try:
                history = json.loads(path.read_text())
                rows, lr = history[EPOCHS], history[LR]
                ok = all("epoch" in row for row in rows) and isinstance(lr, list)
            except (ValueError, TypeError, KeyError):
                ok = False
            if not ok:
                raise UserError(
                    f"{path}: not a history file of this template (JSON with '{EPOCHS}' rows "
                    f"that have an 'epoch', and '{LR}')"
                )
            label = arg if path.parent == root else str(Path(arg) / path.parent.name)
            runs[label] = history
    names = [Path(label).name for label in runs]
    if len(set(names)) == len(names):  # short labels where the run dir names tell them apart
        runs = dict(zip(names, runs.values(), strict=True))
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cifar_amp.extras.curves.plot",
        description="Overlay the training curves of runs.",
    )
    parser.add_argument("runs", nargs="+", help="run dirs (or multirun dirs)")
    parser.add_argument(
        "-o", "--out", default="curves.png", help="output image (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    with reported():
        runs = load(args.runs)
        out = Path(args.out)
        write(runs, out)
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''}: {', '.join(runs)})")


if __name__ == "__main__":
    main()
