"""Every use of a private Lightning or torch name, in one place.

Each is here because no public API does the job (the reason is beside it). A release that
renames one breaks only this file, and tests/test_private.py, which touches every name on the
installed versions, says which.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.amp import GradScaler
from torch.optim import Optimizer

# The base of BatchNorm1d/2d/3d, SyncBatchNorm and the lazy variants: the one type that means
# "has BatchNorm running statistics". No public base class exists.
BatchNorm = nn.modules.batchnorm._BatchNorm


def is_local_path(path) -> bool:
    """Whether `path` is on the local filesystem (no fsspec protocol such as s3://), by the rule
    Lightning's own checkpoint code uses."""
    # Imported here: models/ use this module and stay free of Lightning.
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

    return _is_local_file_protocol(path)


def set_received_sigterm(trainer, value: bool) -> None:
    """Set or clear the flag Lightning's training loop checks at each batch boundary to stop on
    SIGTERM. `Trainer.received_sigterm` is a read-only property over this connector flag."""
    trainer._signal_connector.received_sigterm = value


def scale_tensor(scaler: GradScaler) -> Tensor | None:
    """The GradScaler's scale as the device tensor it keeps (None before its first use).
    `GradScaler.get_scale()` returns a Python float, which is a device sync per call."""
    return scaler._scale


def flat_params(params: dict) -> dict:
    """`params` flattened to `a/b` keys exactly as Lightning's loggers flatten hyperparameters
    (MLFlowLogger.log_hyperparams), so that a continued MLflow run can be told which params it
    already has (MLflow refuses to log a param twice with another value)."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict

    return _flatten_dict(_convert_params(params))


def optimizer_unscales(optimizer: Optimizer) -> bool:
    """Whether the optimizer unscales the gradients inside its own step (the fused Adam, AdamW
    and SGD): GradScaler then passes it the scale and the inf flag on the device instead of
    reading the flag on the host, and Lightning skips its `unscale_` (so it cannot clip)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)
