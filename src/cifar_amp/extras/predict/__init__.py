"""The predict extra: `python predict.py`, `python -m cifar_amp.extras.predict.export`
(README.md here: predictions, export, serving)."""

NEEDS = ("images",)  # the extras it uses (docs/fork.md); none: it stands alone
OUTSIDE = ("predict.py",)  # its files outside its two folders: the command, at the top
