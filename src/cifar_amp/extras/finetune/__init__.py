"""The finetune extra: `init_from=<checkpoint>`, `model=timm`."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
