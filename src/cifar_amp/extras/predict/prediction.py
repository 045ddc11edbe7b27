"""Extra (docs/fork.md): `python predict.py ckpt_path=<ckpt> input=<folder | image file | CIFAR
batch file>` writes `<run_dir>/predictions.csv`. The checkpoint's `data_meta` says what its
network expects, so no data set is needed. Nothing in the core imports this module."""

from __future__ import annotations

import csv
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from cifar_amp import build, runs
from cifar_amp.checkpoints import SETTINGS, Checkpoint
from cifar_amp.data.cifar import SPECS, read_batch
from cifar_amp.errors import UserError
from cifar_amp.extras.images.images import SUFFIXES, decode, eval_resize, eval_transform
from cifar_amp.extras.predict.meta import KEY, cifar_meta
from cifar_amp.tta import TestTimeAugmented

log = logging.getLogger(__name__)

CSV_NAME = "predictions.csv"
SHOWN = 5  # rows of the summary


@dataclass
class PredictConfig:
    """The top of `src/cifar_amp/extras/predict/configs/predict.yaml`: network and class names come from the checkpoint."""

    precision: Any = None
    trainer: Any = None
    run_dir: str = "${hydra:runtime.output_dir}"  # predictions.csv
    ckpt_path: Optional[str] = None  # required: the checkpoint to predict with
    input: Optional[str] = None  # required: a folder of images, an image file, a CIFAR batch file
    batch_size: int = 256  # images per forward pass
    tta: Optional[str] = None  # test-time augmentation; null: the checkpoint's (module.tta)
    trust_checkpoint: bool = False  # as in train.yaml


def data_meta(ckpt: Checkpoint) -> dict:
    """What the network expects (class names, mean/std, image size); for a checkpoint without
    `data_meta`, its CIFAR data set's. Without mean/std it is refused; without names, classes
    go by index (their count: `class_count`)."""
    n, meta = ckpt.hparams.get("num_classes"), ckpt.hparams.get(KEY)
    where = f"{ckpt.key}={ckpt.path}"
    if meta is None:
        dataset = ckpt.data.get(SETTINGS, {}).get("data.dataset")
        if dataset is None and "CIFARDataModule" in ckpt.data:  # older than the settings too
            dataset = next((k for k, s in SPECS.items() if s.num_classes == n), None)
        if dataset not in SPECS or n not in (None, SPECS[dataset].num_classes):
            raise UserError(
                f"{where} does not say what its network expects (no data_meta: its "
                f"DataModule, {dataset or 'unknown'}, has no `meta`); add a `meta` property "
                "to the DataModule (src/cifar_amp/extras/predict/README.md) and train again"
            )
        log.warning(
            f"{where} has no data_meta (written before it, or without the predict extra's "
            f"callbacks): assuming {dataset}'s normalisation, classes and size"
        )
        return cifar_meta(SPECS[dataset])
    if missing := [k for k in ("mean", "std", "image_size") if not meta.get(k)]:
        raise UserError(
            f"{where}: its data_meta lacks {', '.join(missing)}, which say how the network's "
            "images were normalised and sized; add them to the DataModule's `meta`"
        )
    if not meta.get("class_names"):
        log.warning("%s names no classes: classes go by their index", where)
    return meta


# -- what predict and export ask of the checkpoint's module (docs/fork.md, "Your own
# LightningModule"): forward(images) -> logits, or test's TTA where it has one.
def load(ckpt: Checkpoint, entry: str, tta: str | None, **overrides) -> L.LightningModule:
    """The module that trained `ckpt`, with the test-time augmentation `tta` (None: its own),
    which only a tta.TestTimeAugmented module has; `entry` names the command in an error."""
    module = build.module_from_checkpoint(ckpt, **overrides, **({"tta": tta} if tta else {}))
    if tta and not isinstance(module, TestTimeAugmented):
        raise UserError(
            f"tta={tta}: {entry} predicts with the module's forward, as {type(module).__name__} "
            "has no test-time augmentation of its own (tta.TestTimeAugmented); drop tta="
        )
    return module


def logits(module: L.LightningModule, x: Tensor) -> Tensor:
    """What test evaluates `module` by on images `x`: its TTA where it has one, else forward."""
    return module.tta(x) if isinstance(module, TestTimeAugmented) else module(x)


def tta_mode(module: L.LightningModule) -> str:
    return module.tta_mode if isinstance(module, TestTimeAugmented) else "none"


def class_count(module: L.LightningModule, meta: dict, entry: str) -> int:
    """How many classes `module` tells apart: the width of its logits on one blank image of
    data_meta's size, which must be (1, classes) and agree with `hparams.num_classes` and the
    class names where the checkpoint has them. One line naming what is amiss otherwise."""
    h, w = meta["image_size"]
    needs = (
        f"{entry} needs the module's forward(images) -> logits: float32 images (N, 3, H, W), "
        f"normalised as in training, to (N, classes); {type(module).__name__}'s forward of one "
        f"{h}x{w} image"
    )
    try:
        with torch.no_grad():
            out = logits(module, torch.zeros(1, 3, h, w))
    except Exception as e:
        raise UserError(f"{needs} raised {type(e).__name__}: {e}") from e
    if not (isinstance(out, Tensor) and out.dim() == 2 and out.shape[0] == 1):
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise UserError(f"{needs} returned {got}")
    n, said = out.shape[1], module.hparams.get("num_classes")
    if said not in (None, n):
        raise UserError(f"{needs} gave {n} logits, but its hparams.num_classes is {said}")
    names = meta.get("class_names")
    if names and len(names) != n:
        raise UserError(f"the checkpoint's data_meta names {len(names)} classes, the net has {n}")
    return n


def normaliser(meta: dict) -> v2.Transform:
    """uint8 batches -> float32, normalised as the DataModule normalised them in training."""
    return v2.Compose(
        [v2.ToDtype(torch.float32, scale=True), v2.Normalize(meta["mean"], meta["std"])]
    )


# -- what predict and export read: image files or a CIFAR batch file, as uint8 images at the
# network's resolution; files that cannot be decoded are listed, not fatal.
@dataclass
class Inputs:
    """Readable images in input order, and what could not be read."""

    names: list[str]  # one per image: a path relative to the input, or `<batch file>[i]`
    images: torch.Tensor  # (N, 3, H, W) uint8 at the network's resolution
    labels: list[str] | None = None  # true class names, where the input carries them
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (name, why)


def read(path: str | Path, meta: dict, num_classes: int) -> Inputs:
    """`path` for a network that expects `meta`; UserError if nothing can be read."""
    root = Path(path)
    if root.is_dir():
        hidden = lambda p: any(part.startswith(".") for part in p.relative_to(root).parts)  # noqa: E731
        files = sorted(
            p
            for p in root.rglob("*")
            if p.suffix.lower() in SUFFIXES and p.is_file() and not hidden(p)
        )
        if not files:
            raise UserError(
                f"input={path} holds no images ({', '.join(SUFFIXES)}, in any subfolder){_batch_file_hint(root)}"
            )
        return _read_images(files, root, meta["image_size"])
    if not root.is_file():
        raise UserError(f"input={path}: no such file or folder")
    if root.suffix.lower() in SUFFIXES:
        return _read_images([root], root.parent, meta["image_size"])
    return read_batch_file(root, meta, num_classes)


def _batch_file_hint(root: Path) -> str:
    names = {p.name for p in root.iterdir()}
    for spec in SPECS.values():
        if found := [n for n in spec.files("test") + spec.files("train") if n in names]:
            return f"; for a CIFAR batch file give the file itself, e.g. input={root / found[0]}"
    return ""


def _read_images(files: list[Path], root: Path, image_size: list[int]) -> Inputs:
    to_size = eval_transform(image_size)
    names, images, unreadable = [], [], []
    for path in files:
        name = path.relative_to(root).as_posix()
        try:
            rgb = decode(str(path))
        except UserError as e:
            cause = e.__cause__ or e
            unreadable.append((name, f"{type(cause).__name__}: {cause}".replace(str(path), name)))
            continue
        names.append(name)
        images.append(to_size(rgb))
    h, w = image_size
    stacked = torch.stack(images) if images else torch.empty(0, 3, h, w, dtype=torch.uint8)
    return Inputs(names, stacked, unreadable=unreadable)


def read_batch_file(path: Path, meta: dict, num_classes: int) -> Inputs:
    """A file in CIFAR's python format; one of a dataset the network was not trained on (by its
    labels and the names file beside it) is refused."""
    try:
        data, ids, key = read_batch(path)
    except UserError as e:
        raise UserError(
            f"input={path} is neither an image ({', '.join(SUFFIXES)}) nor a CIFAR batch file ({e})"
        ) from e
    ours = meta.get("class_names")
    spec = SPECS.get({"labels": "cifar10", "fine_labels": "cifar100"}.get(key))  # by label key
    theirs = spec and cifar_meta(spec, path.parent)["class_names"]
    if theirs is not None and (list(theirs) != list(ours) if ours else len(theirs) != num_classes):
        trained = f"{num_classes}" + (f": {', '.join(ours[:3])}, ..." if ours else "")
        raise UserError(
            f"input={path} is labelled for other classes ({len(theirs)}: {', '.join(theirs[:3])}, ...) "
            f"than the checkpoint was trained on ({trained}): use a checkpoint trained on that dataset"
        )
    if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= num_classes):
        raise UserError(
            f"input={path} has labels in [{ids.min()}, {ids.max()}], beyond the checkpoint's "
            f"{num_classes} classes: use a checkpoint trained on that dataset"
        )
    labels = None if ids is None else [ours[i] if ours else str(i) for i in ids]
    images = eval_resize(meta["image_size"])(torch.from_numpy(data))
    return Inputs([f"{path.name}[{i}]" for i in range(len(data))], images, labels)


class Probabilities(L.LightningModule):
    """What `trainer.predict` runs: `module`'s class probabilities (float32) of `logits`."""

    def __init__(self, module: L.LightningModule) -> None:
        super().__init__()
        self.module = module

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return logits(self.module, batch).float().softmax(-1)


def _collate(transform: v2.Transform, channels_last: bool, items: list) -> torch.Tensor:
    x = transform(torch.stack(items))
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def predict(cfg: DictConfig) -> dict[str, Any]:
    """Predict `cfg.input` into `<run_dir>/predictions.csv`, print a summary; unreadable files
    raise (exit 2) after the others are written."""
    if not cfg.ckpt_path:
        raise UserError("ckpt_path is required, e.g. ckpt_path=<run>/checkpoints/last.ckpt")
    if not cfg.input:
        raise UserError(
            "input is required: a folder of images, an image file or a CIFAR batch file"
        )
    if cfg.batch_size < 1:
        raise UserError(f"invalid config value for batch_size: {cfg.batch_size}; must be >= 1")
    ckpt = Checkpoint(cfg.ckpt_path, trust=cfg.trust_checkpoint)
    meta = data_meta(ckpt)
    prec = build.precision(cfg, ckpt)  # auto: the mode the checkpoint trained in
    trainer = build.trainer(cfg, prec)
    if trainer.world_size > 1:
        raise UserError(
            f"predict runs in one process; trainer.devices={cfg.trainer.devices} with "
            f"trainer.num_nodes={cfg.trainer.num_nodes} asks for {trainer.world_size}"
        )
    module = load(ckpt, "predict.py", cfg.tta, channels_last=prec.channels_last)
    num_classes = class_count(module, meta, "predict.py")
    names = meta.get("class_names") or [str(i) for i in range(num_classes)]
    inputs = read(cfg.input, meta, num_classes)
    for name, why in inputs.unreadable:
        log.warning("cannot read %s: %s", name, why)
    unread = ", ".join(n for n, _ in inputs.unreadable)
    if not inputs.names:
        raise UserError(
            f"none of the {len(inputs.unreadable)} images in input={cfg.input} could be read: "
            + unread
        )
    runs.save_config(cfg)
    collate = functools.partial(_collate, normaliser(meta), prec.channels_last)
    loader = DataLoader(inputs.images, batch_size=cfg.batch_size, collate_fn=collate)
    probs = torch.cat(trainer.predict(Probabilities(module), dataloaders=loader)).cpu()
    out = Path(cfg.run_dir) / CSV_NAME
    write_csv(out, inputs, probs, names)
    print(summary(cfg, module, prec.name, inputs, probs, names, out))
    if inputs.unreadable:
        total = len(inputs.names) + len(inputs.unreadable)
        raise UserError(
            f"{len(inputs.unreadable)} of {total} files could not be read and were not "
            f"predicted: {unread} (reasons above); predictions for the other "
            f"{len(inputs.names)} are in {out}"
        )
    return {"csv": str(out), "images": len(inputs.names)}


def write_csv(path: Path, inputs: Inputs, probs: torch.Tensor, names: list[str]) -> None:
    """file, label (the input's own, where it has one), class, probability, p_<each class>."""
    best, idx = probs.max(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "label", "class", "probability", *(f"p_{n}" for n in names)])
        for i, name in enumerate(inputs.names):
            label = inputs.labels[i] if inputs.labels else ""
            row = [name, label, names[idx[i]], f"{best[i]:.6f}"]
            w.writerow(row + [f"{p:.6f}" for p in probs[i].tolist()])


def summary(cfg, module, precision: str, inputs, probs, names, out: Path) -> str:
    n = len(inputs.names)
    lines = [
        f"Predicted {n} image(s) of input={cfg.input} with {network_name(module)} "
        f"({len(names)} classes, tta={tta_mode(module)}, precision={precision})"
    ]
    top, predicted = probs.topk(min(3, len(names)), dim=1), probs.argmax(1)
    for i in range(min(n, SHOWN)):
        (p, *ps), (c, *cs) = top.values[i].tolist(), top.indices[i].tolist()
        rest = ", ".join(f"{names[k]} {q:.3f}" for k, q in zip(cs, ps, strict=True))
        lines.append(f"  {inputs.names[i]}: {names[c]} {p:.3f}" + (f" ({rest})" if rest else ""))
    if n > SHOWN:
        counts = torch.bincount(predicted, minlength=len(names)).tolist()
        ranked = sorted(range(len(names)), key=lambda k: -counts[k])
        lines.append(
            f"  ... and {n - SHOWN} more; predicted most: "
            + ", ".join(f"{names[k]} {counts[k]}" for k in ranked[:5] if counts[k])
        )
    if inputs.labels:
        hits = sum(names[k] == y for k, y in zip(predicted.tolist(), inputs.labels, strict=True))
        lines.append(f"  accuracy against the input's labels: {hits / n:.1%} ({hits}/{n})")
    for name, why in inputs.unreadable:
        lines.append(f"  unreadable, not predicted: {name} ({why})")
    lines.append(f"Wrote {out}")
    return "\n".join(lines)


def network_name(module: L.LightningModule) -> str:
    """The network's class where the module records its config (ours: `hparams.net`), else
    the module's."""
    net = module.hparams.get("net")
    target = net.get("_target_") if isinstance(net, Mapping) else None
    return (target or type(module).__name__).rsplit(".", 1)[-1]


def main(cfg: DictConfig) -> None:
    predict(cfg)
