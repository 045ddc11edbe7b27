"""A callback that breaks exact resume on purpose, for bench/tests/test_kill_campaign.py: the
campaign must catch it. A module of its own: train.py imports it, without the tests' conftest."""

from lightning.pytorch import Callback


class DropLoaderPosition(Callback):
    """Writes every checkpoint without the data module's state (the training loader's epoch
    and position): a run resumed mid-epoch starts that epoch's batches over."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint.pop(type(trainer.datamodule).__qualname__)
