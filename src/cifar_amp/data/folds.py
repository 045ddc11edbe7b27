"""K-fold cross-validation of a training set: which images validate, stratified by class.

Every DataModule that takes `folds` and `fold` (CIFARDataModule here; any other, docs/fork.md)
checks them with `check` in its constructor and splits its training set with `fold_split` once
it has the labels, so a fold holds the same images whichever process or DDP rank computes it.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from cifar_amp.errors import InvalidArgument, UserError


def check(folds: int | None, fold: int | None) -> None:
    """Refuse a `folds`/`fold` pair that names no fold; both null means no folds."""
    if folds is None and fold is None:
        return
    if folds is None:
        raise InvalidArgument("fold", fold, "needs data.folds=K, the number of folds")
    if folds < 2:
        raise InvalidArgument("folds", folds, "must be >= 2 (null: no folds)")
    # No default fold: a run of fold 0 alone must not pass for a cross-validation.
    if fold is None:
        every = f"every fold, one job each: -m data.folds={folds} 'data.fold=range({folds})'"
        raise InvalidArgument(
            "fold", None, f"set data.fold in [0, {folds}), the fold that validates ({every})"
        )
    if not 0 <= fold < folds:
        raise InvalidArgument("fold", fold, f"must be in [0, {folds}) with data.folds={folds}")


def stratified_folds(
    labels: Tensor, k: int, seed: int, class_names: Sequence[str] | None = None
) -> list[Tensor]:
    """`k` disjoint sorted index tensors whose union is `range(len(labels))`: each class's
    indices, in an order drawn from `seed`, dealt round-robin into the folds, each class
    starting where the previous one stopped, so every fold holds each class's share (counts
    differ by at most 1 per class) and the folds' sizes differ by at most 1. A class with
    fewer than `k` images would miss from some folds: one line naming it (by `class_names`,
    else its label)."""
    labels = labels.cpu()
    classes, counts = labels.unique(return_counts=True)
    smallest = int(counts.argmin())
    fewest = int(counts[smallest])
    if fewest < k:
        label = int(classes[smallest])
        name = class_names[label] if class_names is not None else str(label)
        advice = f"use data.folds<={fewest}" if fewest >= 2 else "folds need 2 of each class"
        raise UserError(
            f"data.folds={k} is more than the {fewest} training images of class {name} (the "
            f"smallest class): every fold must hold each class; {advice}"
        )
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    dealt = torch.empty(len(labels), dtype=torch.int64)  # the fold of each image
    start = 0
    for c in classes:
        members = order[labels[order] == c]
        dealt[members] = (torch.arange(len(members)) + start) % k
        start = (start + len(members)) % k
    return [torch.nonzero(dealt == i).flatten() for i in range(k)]


def fold_split(
    labels: Tensor, k: int, fold: int, seed: int, class_names: Sequence[str] | None = None
) -> tuple[Tensor, Tensor]:
    """(training indices, validation indices), sorted: fold `fold` of `stratified_folds`
    validates, the other `k - 1` folds train."""
    parts = stratified_folds(labels, k, seed, class_names)
    train = torch.cat([p for i, p in enumerate(parts) if i != fold]).sort().values
    return train, parts[fold]
