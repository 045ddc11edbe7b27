"""A Hydra task without torch for the sweeper's end-to-end tests (tests/extras/sweeps/test_sweeper.py).

It 'trains' for `epochs` epochs: the score peaks at x = 0.3 and grows with the epochs; it
reports the score to its Optuna trial each epoch and stops when the pruner says so, as
cifar_amp.extras.sweeps.pruning does. `fail` picks a bad ending. Each job writes job.json (its process, its
devices and threads, its trial, when it ran) into its directory."""

import json
import math
import os
import time
from dataclasses import dataclass

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper.trial import PRUNED_AT, current_trial


@dataclass
class Config:
    x: float = 0.0
    c: str = "a"
    epochs: int = 4
    fail: str = "none"  # none | nan_value | raise | pruned (raises optuna.TrialPruned)
    sleep: float = 0.0  # seconds per epoch


ConfigStore.instance().store(name="config", node=Config)


def only_a(params: dict, config) -> dict:
    """A `hydra.sweeper.restrict` for the tests: `c` is searched over `a` alone, here."""
    assert config.epochs >= 1  # the sweep's own config
    return params | {"c": "choice(a)"}


@hydra.main(version_base="1.3", config_path=None, config_name="config")
def main(cfg: Config) -> float:
    trial = current_trial()
    out = HydraConfig.get().runtime.output_dir
    info = {
        "pid": os.getpid(),
        "trial": trial.number if trial else None,
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "t0": time.time(),
    }
    try:
        best = -math.inf
        for epoch in range(cfg.epochs):
            time.sleep(cfg.sleep)
            score = (1 - abs(cfg.x - 0.3)) * (epoch + 1) / cfg.epochs + 0.1 * (cfg.c == "b")
            best = max(best, score)
            if trial is not None:
                trial.report(score, epoch)
                if trial.should_prune():
                    trial.set_user_attr(PRUNED_AT, epoch)
                    break
        if cfg.fail == "nan_value":
            return math.nan
        if cfg.fail == "raise":
            raise RuntimeError("boom")
        if cfg.fail == "pruned":
            import optuna

            raise optuna.TrialPruned("pruned by the task")
        return best
    finally:
        info["t1"] = time.time()
        with open(os.path.join(out, "job.json"), "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    main()
