"""The predict extra: `python predict.py`, `python -m cifar_amp.extras.predict.export`
(README.md here: predictions, export, serving); every checkpoint keeps what its network expects
of images (`data_meta`, its DataMeta callback)."""

NEEDS = ("images",)  # the extras it uses (docs/fork.md); none: it stands alone
OUTSIDE = ("predict.py",)  # its files outside its two folders: the command, at the top
# What `python train.py` loses without it, an extra the default run uses (docs/fork.md).
DEFAULT_RUN_LOSES = (
    "`data_meta` in each checkpoint, which only predict and export (this extra's) read"
)
