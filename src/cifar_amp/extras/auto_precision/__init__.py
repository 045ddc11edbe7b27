"""The auto_precision extra: `precision=auto`: the fastest mode whose loss stays finite, chosen by
a probe at fit start."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
