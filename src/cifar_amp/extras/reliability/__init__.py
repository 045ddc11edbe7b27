"""The reliability extra: Atomic checkpoint and CSV-log writes (a kill or a full disk never tears
last.ckpt), checkpoints written on a background thread; SIGTERM/Ctrl+C stop at an accumulation window's end (every DDP rank at the same
one), save last.ckpt and print the resume command; a stop on losses that stay inf/NaN;
`debug=anomaly`."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
# What `python train.py` loses without it, an extra the default run uses (docs/fork.md).
DEFAULT_RUN_LOSES = (
    "atomic checkpoint and metrics.csv writes (a kill or a full disk can then tear "
    "last.ckpt), checkpoints written off the training thread, the stop at a window's end and save of last.ckpt on SIGTERM/Ctrl+C with "
    "the resume command, and the stop on losses that stay inf/NaN"
)
