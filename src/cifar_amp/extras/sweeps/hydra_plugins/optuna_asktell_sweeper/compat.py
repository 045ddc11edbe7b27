"""The private Hydra, Optuna and submitit names the sweeps extra and its tests use (the form of src/cifar_amp/compat.py).
Nothing here imports optuna: Hydra imports every plugin at start-up."""

from typing import Any

from hydra.core.utils import JobReturn


# JobReturn._return_value: what a failed job raised (the public return_value re-raises it and writes to stderr), which the sweeper records as the trial's reason. Fails: tests/extras/sweeps/test_sweeper.py::test_each_end_of_a_job_is_recorded
def raised(ret: JobReturn) -> Any:
    return ret._return_value


# optuna Trial._trial_id: the storage's id of a trial, by which a job's process re-opens it (optuna.trial.Trial(study, id)); the public number is the study's count. Fails: tests/extras/sweeps/test_sweeper.py::test_a_job_reopens_its_trial_by_the_id_it_is_given
def trial_id(trial: Any) -> int:
    return trial._trial_id


# submitit's Executor._executor._make_submission_file_text: the sbatch script submitit would submit, read without a SLURM cluster. Fails: tests/extras/sweeps/test_slurm.py::test_slurm_launcher_asks_for_the_trainers_nodes_and_gpus
def sbatch_script(executor, command: str) -> str:
    return executor._executor._make_submission_file_text(command, "0")
