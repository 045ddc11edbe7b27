"""The private Lightning names the reliability extra uses (the form of src/cifar_amp/compat.py)."""

from __future__ import annotations

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop


# _is_local_file_protocol (lightning.fabric.utilities.cloud_io): Lightning's own rule for a path without an fsspec protocol (s3://, ...), which the atomic writer writes itself. Fails: tests/extras/reliability/test_reliability.py::test_local_path_rule
def is_local_path(path) -> bool:
    return _is_local_file_protocol(path)


# Trainer._signal_connector.received_sigterm: the flag Lightning checks at each batch boundary to stop; Trainer.received_sigterm is read-only. Fails: tests/extras/reliability/test_reliability.py::test_sigterm_flag_is_the_one_the_trainer_reads
def set_received_sigterm(trainer, value: bool) -> None:
    trainer._signal_connector.received_sigterm = value


# _TrainingEpochLoop._broadcast_sigterm_tensor: under DDP Lightning 2.6 broadcasts its SIGTERM flag from rank 0 and reads it with .item() at every step, a collective and a sync per step (Lightning issue 21487; PR 21640 proposes a setting); SaveOnSignal shares the flag itself and turns it off on the run's loop. Fails: tests/extras/reliability/test_ddp_signals.py::test_lightning_still_broadcasts_its_sigterm_flag_at_every_step
def no_flag_broadcast_per_step(trainer) -> None:
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


# _TrainingEpochLoop._broadcast_sigterm_tensor: the method itself, which the test of no_flag_broadcast_per_step finds Lightning still has. Fails: tests/extras/reliability/test_ddp_signals.py::test_lightning_still_broadcasts_its_sigterm_flag_at_every_step
def lightning_broadcasts_sigterm_flag() -> bool:
    return callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))
