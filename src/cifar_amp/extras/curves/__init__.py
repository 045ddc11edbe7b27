"""The curves extra: `history.json` and `curves.png` in every run dir, `confusion.png` where a test
ran (train.py's and eval.py's); `python -m cifar_amp.extras.curves.plot`."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
# What `python train.py` loses without it, an extra the default run uses (docs/fork.md).
DEFAULT_RUN_LOSES = "`history.json`, `curves.png` and `confusion.png` in the run dir"
