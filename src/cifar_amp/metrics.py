"""Metric names and metrics.json keys, defined once; YAML names them as ``${metric:NAME}``."""

TRAIN_LOSS = "train/loss"
TRAIN_ACC = "train/acc"
VAL_LOSS = "val/loss"
VAL_ACC = "val/acc"
VAL_ACC_BEST = "val/acc_best"
TEST_LOSS = "test/loss"
TEST_ACC = "test/acc"
PRECISION = "precision"  # the mode trained in, the chosen one where the precision chooses
EPOCHS = "epochs"
FIT_SECONDS = "fit_seconds"  # wall time of trainer.fit, with its set-up, validation and checkpoints
TESTED_CKPT = "tested_ckpt"

BY_NAME = {k.lower(): v for k, v in globals().items() if k.isupper() and isinstance(v, str)}


def resolve(name: str) -> str:  # ${metric:val_acc} -> "val/acc"
    if name.lower() not in BY_NAME:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(sorted(BY_NAME))}")
    return BY_NAME[name.lower()]


def tested(trainer) -> dict:
    """What `trainer.test` logged, as metrics.json holds it (train.py's and eval.py's)."""
    return {k: float(trainer.callback_metrics[k]) for k in (TEST_ACC, TEST_LOSS)}
