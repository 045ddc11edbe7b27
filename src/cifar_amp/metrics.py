"""Metric names and metrics.json keys, defined once; YAML names them as ``${metric:NAME}``."""

LOSS = "loss"  # every stage's, beside the module's configured metrics (module.metrics)
ACC = "acc"  # the default metric's name (module.ImageClassifier's `metrics`)


def key(stage: str, name: str) -> str:  # key("val", "acc") -> "val/acc"
    return f"{stage}/{name}"


def best(name: str) -> str:  # best("acc") -> "val/acc_best": the best validation value so far
    return f"{key('val', name)}_best"


TRAIN_LOSS = key("train", LOSS)
TRAIN_ACC = key("train", ACC)
VAL_LOSS = key("val", LOSS)
VAL_ACC = key("val", ACC)
VAL_ACC_BEST = best(ACC)  # of the default monitor (config.Monitor)
TEST_LOSS = key("test", LOSS)
TEST_ACC = key("test", ACC)
TEST_ACC_PER_CLASS = "test/acc_per_class"  # {class name: accuracy} in metrics.json
PRECISION = "precision"  # the mode trained in, the chosen one where the precision chooses
EPOCHS = "epochs"
FIT_SECONDS = "fit_seconds"  # wall time of trainer.fit, with its set-up, validation and checkpoints
TESTED_CKPT = "tested_ckpt"
MONITOR = "monitor"  # eval.py's metrics.json: the metric that ranked the checkpoint's run

BY_NAME = {k.lower(): v for k, v in globals().items() if k.isupper() and isinstance(v, str)}


def resolve(name: str) -> str:  # ${metric:val_acc} -> "val/acc"
    if name.lower() not in BY_NAME:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(sorted(BY_NAME))}")
    return BY_NAME[name.lower()]
