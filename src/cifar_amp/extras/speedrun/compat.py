"""The private Lightning and torch names the speedrun extra uses (the form of
src/cifar_amp/compat.py)."""

from __future__ import annotations

import torch
from torch import Tensor


# WeightAveraging._average_model: the AveragedModel that Lightning's EMAWeightAveraging keeps (no public accessor), which EMA updates in one foreach step. Fails: tests/extras/speedrun/test_speed_recipe.py::test_ema_keeps_lightnings_averages_and_checkpoint
def average_model(callback) -> torch.optim.swa_utils.AveragedModel:
    return callback._average_model


# WeightAveraging._device, ._use_buffers: the constructor's device= and use_buffers=, which Lightning keeps only privately. Fails: tests/extras/speedrun/test_speed_recipe.py::test_ema_keeps_lightnings_averages_and_checkpoint
def averaging_settings(callback) -> tuple[torch.device | str | None, bool]:
    """(where the average is kept, None: beside the weights; whether buffers are averaged)."""
    return callback._device, callback._use_buffers


# torch._foreach_copy_: a list of tensors copied in one kernel launch (AveragedModel copies them one by one). Fails: tests/extras/speedrun/test_speed_recipe.py::test_ema_keeps_lightnings_averages_and_checkpoint
def copy_all(targets: list[Tensor], sources: list[Tensor]) -> None:
    torch._foreach_copy_(targets, sources)
