"""The multirun extra: In a `-m` sweep, a job whose values are wrong fails alone (one line in its
`error.txt`, NaN to the sweeper), on any DDP rank, and its ranks end with it; the sweep ends
with a summary, one row per setting over its seeds and folds (mean +- std (n) of each metric,
`summary.md/.csv/.png`; `python -m cifar_amp.extras.multirun.summary <sweep dir>` afterwards),
naming the failed jobs, exit 2 if there are any. Without it, a sweep stops at its first failed
job; DDP jobs in a sweep need it."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
# What `python train.py` loses without it, an extra the default run uses (docs/fork.md).
DEFAULT_RUN_LOSES = (
    "nothing in a single run; in a `-m` sweep the first failed job stops the sweep, "
    "DDP jobs in a sweep do not work, and the sweep ends without its summary"
)
