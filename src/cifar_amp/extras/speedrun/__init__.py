"""The speedrun extra: `experiment=speedrun` and `speedrun_gpu`: patch-whitening stem, EMA of the
weights."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
