"""hydra/launcher=slurm composes into the sbatch script we mean, without submitting it."""

from __future__ import annotations

import os

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from conftest import compose_cfg

# The sweeps extra's: without it this module skips (collecting it must not fail `pytest -m gpu`).
submitit = pytest.importorskip("submitit")
pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
from hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper import (  # noqa: E402
    compat as sweeper_compat,
)
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf  # noqa: E402


def sbatch_script(overrides: list[str], folder) -> str:
    """The script SlurmLauncher.launch would submit: its parameter translation, then submitit's."""
    cfg = compose_cfg("train", overrides, return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    HydraConfig.instance().set_config(cfg)
    try:
        params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    finally:
        HydraConfig.instance().cfg = None
    del params["_target_"], params["submitit_folder"]
    executor = submitit.AutoExecutor(
        folder=folder, cluster="slurm", slurm_max_num_timeout=params.pop("max_num_timeout")
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    return sweeper_compat.sbatch_script(executor, "python -u -m submitit.core._submit x")


@pytest.mark.parametrize("search", [(), ("hparams_search=optuna",)], ids=["grid", "optuna"])
def test_slurm_launcher_asks_for_the_trainers_nodes_and_gpus(tmp_path, monkeypatch, search):
    fake = tmp_path / "bin" / "srun"  # submitit refuses to build an executor off-cluster
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    script = sbatch_script(
        [
            "hydra/launcher=slurm",
            "trainer=ddp",
            "trainer.devices=4",
            "trainer.num_nodes=2",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=90",
            *search,
        ],
        tmp_path,
    )
    lines = set(script.splitlines())
    for expected in (
        "--nodes=2",
        "--gpus-per-node=4",
        "--ntasks-per-node=4",
        "--partition=gpu",
        "--time=90",
    ):
        assert f"#SBATCH {expected}" in lines, expected
    # Lightning's auto-requeue listens on SIGUSR1: that is the only signal SLURM is asked for.
    assert [ln for ln in lines if "--signal" in ln] == ["#SBATCH --signal=USR1@120"]
