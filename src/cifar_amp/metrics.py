"""Metric names, defined once. Code imports these constants; YAML refers to them through the
``${metric:NAME}`` resolver (registered in :mod:`cifar_amp.config`)."""

TRAIN_LOSS = "train/loss"
TRAIN_ACC = "train/acc"
VAL_LOSS = "val/loss"
VAL_ACC = "val/acc"
VAL_ACC_BEST = "val/acc_best"
TEST_LOSS = "test/loss"
TEST_ACC = "test/acc"

# Keys of metrics.json besides the metrics logged during fit (which it holds too, as their
# last values: an extra's callback that logs one adds it there).
PRECISION = "precision"  # the mode trained in (under precision=auto: the mode it chose)
# precision=auto: `precision_probe/<mode>`, images/s of each candidate in the fit-start probe
# (null: its loss was not finite, so it was rejected); absent when a resume reused the choice.
PRECISION_PROBE = "precision_probe"
EPOCHS = "epochs"
FIT_SECONDS = "fit_seconds"  # wall time of trainer.fit: set-up, training, validation, checkpoints
TESTED_CKPT = "tested_ckpt"

BY_NAME = {k.lower(): v for k, v in globals().items() if k.isupper() and isinstance(v, str)}


def resolve(name: str) -> str:
    """``${metric:val_acc}`` -> ``"val/acc"``; an unknown name lists the known ones."""
    try:
        return BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(sorted(BY_NAME))}") from None
