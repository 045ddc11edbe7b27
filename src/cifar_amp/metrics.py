"""Metric names: defined here once. Code imports these constants; YAML refers to them
through the ``${metric:NAME}`` resolver (registered in :mod:`cifar_amp.config`)."""

TRAIN_LOSS = "train/loss"
TRAIN_ACC = "train/acc"
VAL_LOSS = "val/loss"
VAL_ACC = "val/acc"
VAL_ACC_BEST = "val/acc_best"
TEST_LOSS = "test/loss"
TEST_ACC = "test/acc"

# Precision diagnostics (callbacks/precision_diagnostics.py), logged once per epoch.
SCALE = "precision/scale"  # GradScaler scale at epoch end (16-mixed only)
SKIPPED_STEPS = (
    "precision/skipped_steps"  # optimizer steps skipped for inf/nan grads, since fit start
)
GRAD_NORM = "precision/grad_norm"  # mean L2 norm of the unscaled gradients before clipping
GRAD_NORM_MAX = "precision/grad_norm_max"
CLIP_FRACTION = (
    "precision/clip_fraction"  # fraction of optimizer steps whose gradients clipping changed
)
PEAK_MEMORY_MB = "perf/peak_memory_mb"  # GPU: max allocated in the epoch; CPU: process peak RSS
IMAGES_PER_SEC = "perf/images_per_sec"  # training images per second of the epoch's training loop

# Of the metrics logged during fit, these (last epoch's values) also go into metrics.json.
FIT_SUMMARY = (SCALE, SKIPPED_STEPS, GRAD_NORM, CLIP_FRACTION, PEAK_MEMORY_MB, IMAGES_PER_SEC)

# Keys of metrics.json besides the logged metrics above.
EPOCHS = "epochs"
FIT_SECONDS = "fit_seconds"  # wall time of trainer.fit: set-up, training, validation, checkpoints
# Wall time of the training loop alone (callbacks/timing.py, TrainTimer): every training batch
# of the fit with its data and hooks, from each epoch's start to the end of its last batch; not
# validation, nor the logging and checkpoint writes after an epoch's last batch. The first
# timing.WARMUP_STEPS (3) batches, which compile and autotune, count at the mean time of the
# later batches. On CUDA the clock waits for the GPU at each start and stop.
TRAIN_SECONDS = "train_seconds"
# With module.compile only: what those first batches took beyond that mean (the compilation
# of the training step, autotuning, CUDA-graph capture; not the compilation that validation
# and test trigger later). null if the fit had no batch after them.
COMPILE_SECONDS = "compile_seconds"
PRECISION = "precision"
# The keys that differ from run to run of the same config.
TIMES = (FIT_SECONDS, TRAIN_SECONDS, COMPILE_SECONDS)

BY_NAME = {k.lower(): v for k, v in globals().items() if k.isupper() and isinstance(v, str)}


def resolve(name: str) -> str:
    """``${metric:val_acc}`` -> ``"val/acc"``; an unknown name lists the known ones."""
    try:
        return BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(sorted(BY_NAME))}") from None
