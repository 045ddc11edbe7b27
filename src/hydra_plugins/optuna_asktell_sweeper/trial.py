"""Job side: re-open the trial that the sweeper asked for this job, to report to it and prune.

The sweeper passes the trial through the job's environment (`hydra.job.env_set`). A job whose
trial should be pruned either stops early and records the epoch as the trial's user attribute
PRUNED_AT (its tracker runs and results end normally), or raises `optuna.TrialPruned`; the
sweeper records the trial as PRUNED either way."""

import os
from typing import Any, Optional

STORAGE, STUDY_NAME, TRIAL_ID = "OPTUNA_STORAGE", "OPTUNA_STUDY_NAME", "OPTUNA_TRIAL_ID"
PRUNED_AT = "pruned_at"


def configured_pruner() -> Optional[dict]:
    """This job's `hydra.sweeper.pruner` as a plain dict (a process without Hydra's config,
    such as one that ddp_spawn starts, can still build it); None outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    pruner = HydraConfig.get().sweeper.get("pruner")
    return OmegaConf.to_container(pruner, resolve=True) if pruner else None


def current_trial(pruner: Optional[dict] = None) -> Optional[Any]:
    """This job's running `optuna.trial.Trial`, or None outside an optuna_asktell sweep (or in
    one without a storage). Its `should_prune()` asks the pruner of the config `pruner`, by
    default `configured_pruner()`."""
    if TRIAL_ID not in os.environ:
        return None
    import optuna
    from hydra.utils import instantiate

    pruner = pruner or configured_pruner()
    study = optuna.load_study(
        study_name=os.environ[STUDY_NAME],
        storage=os.environ[STORAGE],
        # The job never samples: its parameters came as overrides.
        sampler=optuna.samplers.RandomSampler(),
        pruner=instantiate(pruner) if pruner else None,
    )
    return optuna.trial.Trial(study, int(os.environ[TRIAL_ID]))
