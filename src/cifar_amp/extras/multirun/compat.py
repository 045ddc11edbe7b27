"""The private Lightning names the multirun extra uses (the form of src/cifar_amp/compat.py)."""

from __future__ import annotations

from typing import Callable

from lightning.pytorch.strategies.launchers import subprocess_script


# subprocess_script._launch_process_observer: the module-level function Lightning's DDP launcher hands each rank process it starts; SweepRanks swaps it to end a failed sweep job's ranks. Fails: tests/extras/multirun/test_multirun.py::test_sweep_ranks_keep_lightnings_ranks_and_end_them
def swap_process_observer(observer: Callable[[list], None]) -> Callable[[list], None]:
    """Make `observer` the one Lightning hands the rank processes it starts; the previous one."""
    previous = subprocess_script._launch_process_observer
    subprocess_script._launch_process_observer = observer
    return previous


# _SubprocessScriptLauncher, ._call_children_scripts: Lightning's DDP launcher, whose rank processes the test of SweepRanks stands in for. Fails: tests/extras/multirun/test_multirun.py::test_sweep_ranks_keep_lightnings_ranks_and_end_them
def ddp_launcher(environment, start_ranks: Callable[[], list]):
    """Lightning's launcher for 1 process of 1 node, whose ranks are `start_ranks()`."""
    launcher = subprocess_script._SubprocessScriptLauncher(environment, 1, 1)
    launcher._call_children_scripts = lambda: launcher.procs.extend(start_ranks())
    return launcher
