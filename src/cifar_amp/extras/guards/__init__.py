"""The guards extra: Trainer settings that Lightning would accept but that would not do what was
asked are refused on one line before the run writes anything: a device that is not here (naming
the recipe or option that chose it), more CPU processes than cores, a DDP run of one process on
CPU, several devices under a one-device strategy, ranks that a script would restart per stage,
bfloat16 on a GPU without it, 16-mixed under Lightning's DeepSpeed, a negative clip value or
accumulation."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
# What `python train.py` loses without it, an extra the default run uses (docs/fork.md).
DEFAULT_RUN_LOSES = (
    "the one-line refusals of trainer settings that would not do what was asked: "
    "Lightning runs them as given, or refuses them itself"
)
