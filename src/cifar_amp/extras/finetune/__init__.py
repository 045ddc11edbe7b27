"""The finetune extra: `init_from=<checkpoint>`, `model=timm`."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
# What `python train.py` loses without it, an extra the default run uses (docs/fork.md).
DEFAULT_RUN_LOSES = "the `init_from=` key; a run that does not set it trains the same"
