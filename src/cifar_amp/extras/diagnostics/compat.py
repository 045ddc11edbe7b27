"""The private torch names the diagnostics extra uses (the form of src/cifar_amp/compat.py)."""

from __future__ import annotations

from torch import Tensor


# GradScaler._scale: the scale as the device tensor the scaler keeps (None before its first use); the public get_scale() returns a float, a device sync per call. Fails: tests/extras/diagnostics/test_precision_diagnostics.py::test_scale_tensor_is_the_scale_without_a_sync
def scale(scaler) -> Tensor | None:
    return scaler._scale


# torch._foreach_norm: the kernel behind every gradient norm (torch.nn.utils.get_total_norm, clip_grad_norm_), which the diagnostics' test counts to show that a clipped step computes the norm once. Fails: tests/extras/diagnostics/test_precision_diagnostics.py::test_a_step_clipped_by_norm_computes_the_norm_once_and_reports_it
FOREACH_NORM = "_foreach_norm"
