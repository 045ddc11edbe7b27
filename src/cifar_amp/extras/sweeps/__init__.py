"""The sweeps extra: `hparams_search=optuna` (our own Optuna sweeper, pruning, no trial on a
precision mode the machine emulates), `hydra/launcher=local` (parallel trials) and `slurm`."""

NEEDS = ("multirun",)  # the extras it uses (docs/fork.md); none: it stands alone
