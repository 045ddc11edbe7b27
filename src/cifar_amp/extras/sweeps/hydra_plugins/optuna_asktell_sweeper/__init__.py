"""A Hydra sweeper on Optuna's ask/tell API: `hydra/sweeper=optuna_asktell` (docs/scaling.md).

Hydra imports every plugin at start-up: nothing here imports optuna."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class OptunaAskTellSweeperConf:
    _target_: str = (
        "hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper.sweeper.OptunaAskTellSweeper"
    )
    _recursive_: bool = False  # sampler and pruner stay configs: the sweeper and jobs build them
    study_name: str = "study"  # with a storage, the same name again resumes the study
    # e.g. sqlite:////abs/path.db (jobs re-open their trials there); None: no pruning, no resume
    storage: Optional[str] = None
    direction: str = "minimize"  # or maximize: what the task function returns
    n_trials: int = 20  # trials added by this run
    n_jobs: int = 1  # trials asked at once and handed to the launcher as one batch
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler"})
    # Built in each job for its own trial (so not one that needs the sampler: HyperbandPruner).
    pruner: Any = field(default_factory=lambda: {"_target_": "optuna.pruners.MedianPruner"})
    params: Dict[str, str] = field(default_factory=dict)  # key: a Hydra sweep, e.g. choice(1, 2)
    # A function's config (`_target_`), called with (params, the sweep's config) as the search
    # starts: the params to search on this machine (the command line still goes over them).
    restrict: Any = None
    # Job i of a batch sees only GPU devices[i % len(devices)] (CUDA_VISIBLE_DEVICES); needs a
    # launcher that starts a new process per job (hydra/launcher=local, SLURM).
    devices: Optional[List[Any]] = None


ConfigStore.instance().store(
    group="hydra/sweeper",
    name="optuna_asktell",
    node=OptunaAskTellSweeperConf,
    provider="optuna_asktell_sweeper",
)
