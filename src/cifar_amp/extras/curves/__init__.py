"""The curves extra: `history.json` and `curves.png` in every run dir; `python -m cifar_amp.extras.curves.plot`."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
# What `python train.py` loses without it, an extra the default run uses (docs/fork.md).
DEFAULT_RUN_LOSES = "`history.json` and `curves.png` in the run dir"
