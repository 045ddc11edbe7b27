"""The diagnostics extra: GradScaler scale and skipped steps, gradient norms and clipping, peak
memory, images/s, `train_seconds`, `compile_seconds` (in metrics.json), the precision set-up at
fit start (plugin, autocast dtype and device, GradScaler settings, TF32)."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
# What `python train.py` loses without it, an extra the default run uses (docs/fork.md).
DEFAULT_RUN_LOSES = (
    "the `precision/*` and `perf/*` metrics (GradScaler scale, skipped steps, gradient "
    "norms, clipping, peak memory, images/s), `train_seconds` in metrics.json, and the "
    "fit-start lines on the precision set-up"
)
