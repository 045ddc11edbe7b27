"""Job side: re-open the trial the sweeper asked for this job (passed in its environment), to
report to it. A pruned job records the epoch as user attribute PRUNED_AT and ends normally, or
raises `optuna.TrialPruned`: the sweeper records PRUNED either way."""

import os
from typing import Any, Optional

STORAGE, STUDY_NAME, TRIAL_ID = "OPTUNA_STORAGE", "OPTUNA_STUDY_NAME", "OPTUNA_TRIAL_ID"
PRUNED_AT = "pruned_at"


def configured_pruner() -> Optional[dict]:
    """This job's `hydra.sweeper.pruner` as a plain dict, which a process without Hydra's config
    (ddp_spawn's) can build; None outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return None
    pruner = HydraConfig.get().sweeper.get("pruner")
    return OmegaConf.to_container(pruner, resolve=True) if pruner else None


def current_trial(pruner: Optional[dict] = None) -> Optional[Any]:
    """This job's running `optuna.trial.Trial`, whose `should_prune()` asks `pruner` (default:
    configured_pruner()); None outside an optuna_asktell sweep with a storage."""
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
