"""The private Lightning names the auto_precision extra uses (the form of
src/cifar_amp/compat.py)."""

from __future__ import annotations


# _configure_optimizers (lightning.pytorch.core.optimizer): Lightning's reading of configure_optimizers' many return forms, so that the probe trains each candidate with the run's own optimizer and schedule. Fails: tests/extras/auto_precision/test_auto_precision.py::test_the_probe_steps_as_the_run_does_and_waits_once_a_window
def optimizers_and_schedulers(returned) -> tuple[list, list]:
    """(optimizers, scheduler configs) of what a module's configure_optimizers returned."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    optimizers, schedulers, _ = _configure_optimizers(returned)
    return optimizers, schedulers
