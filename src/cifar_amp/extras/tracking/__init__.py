"""The tracking extra: `logger=mlflow`, `wandb`, `tensorboard`; a resume continues the tracked run."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
