"""Fine-tuning: a new run that starts from another run's network weights (`init_from=`).

Only the network's weights are taken (with EMA, the averaged ones: those are what the
checkpoint's state_dict holds); the optimizer, schedule, epoch, metrics and loader position
start afresh, unlike `ckpt_path=`, which resumes a run exactly. A classification head sized
for another number of classes is re-initialised; any other difference refuses the run.
"""

from __future__ import annotations

import logging

from torch import Tensor, nn

from cifar_amp.errors import UserError
from cifar_amp.reliability import preflight

log = logging.getLogger(__name__)
PREFIX = "net."  # the network's keys in ImageClassifier's state_dict


def _is_head(theirs: Tensor, ours: Tensor, their_classes: int | None, num_classes: int) -> bool:
    """A tensor that differs only in its first dimension, the number of classes."""
    return (
        theirs.shape[1:] == ours.shape[1:]
        and ours.shape[0] == num_classes
        and theirs.shape[0] == (their_classes or theirs.shape[0])
        and theirs.shape[0] != num_classes
    )


def init_from(path: str, net: nn.Module, num_classes: int, ckpt_path: str | None) -> None:
    """Load the network weights of the checkpoint at `path` into `net` (see the module doc)."""
    if ckpt_path:
        raise UserError(
            f"init_from={path} and ckpt_path={ckpt_path} exclude each other: ckpt_path resumes "
            "a run exactly (weights, optimizer, schedule, epoch), init_from starts a new one "
            "from a checkpoint's weights; drop one"
        )
    ckpt = preflight.load_checkpoint(path, key="init_from")
    hparams = ckpt.get("hyper_parameters", {})
    their_classes = hparams.get("num_classes")
    saved = {k[len(PREFIX) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(PREFIX)}
    ours = net.state_dict()
    load, head, problems = {}, [], []
    for key, value in ours.items():
        if key not in saved:
            continue
        if saved[key].shape == value.shape:
            load[key] = saved[key]
        elif _is_head(saved[key], value, their_classes, num_classes):
            head.append(key)
        else:
            problems.append(f"{key} {tuple(saved[key].shape)} vs {tuple(value.shape)}")
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if missing or extra or problems:
        found = []
        if missing:
            found.append(f"missing from the checkpoint: {preflight.few(missing)}")
        if extra:
            found.append(f"not in this model: {preflight.few(extra)}")
        if problems:
            found.append(f"shapes (checkpoint vs model): {preflight.few(problems)}")
        theirs = (hparams.get("net") or {}).get("_target_", "unknown")
        raise UserError(
            f"init_from={path} does not fit this model (the checkpoint's network: {theirs}; "
            f"check model=...): " + "; ".join(found)
        )
    net.load_state_dict(load, strict=False)
    where = f"epoch {ckpt.get('epoch', '?')}, step {ckpt.get('global_step', '?')}"
    log.info(
        "init_from=%s: loaded %d of the network's %d tensors (checkpoint at %s); optimizer, "
        "schedule and epoch start afresh",
        path,
        len(load),
        len(ours),
        where,
    )
    if head:
        log.info(
            "init_from: re-initialised the classification head for %d classes (the "
            "checkpoint's has %s): %s",
            num_classes,
            their_classes or "another number",
            ", ".join(head),
        )


def saved_without_pretrained(hparams: dict) -> None:
    """Checkpoints hold the network's weights, so the network config they save asks for no
    pretrained weights: rebuilding from one (eval.py, load_from_checkpoint) fetches nothing,
    and works offline."""
    net = hparams.get("net")
    if isinstance(net, dict) and (net.get("pretrained") or net.get("pretrained_path")):
        net.update(pretrained=False, pretrained_path=None)
