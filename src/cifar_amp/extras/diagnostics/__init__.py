"""The diagnostics extra: GradScaler scale and skipped steps, gradient norms and clipping, peak
memory, images/s, `train_seconds`, `compile_seconds` (in metrics.json), the precision set-up at
fit start (plugin, autocast dtype and device, GradScaler settings, TF32)."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
