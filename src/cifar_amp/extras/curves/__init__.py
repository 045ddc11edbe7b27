"""The curves extra: `history.json` and `curves.png` in every run dir; `python -m cifar_amp.extras.curves.plot`."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
