"""Lightning callbacks of the template (configs/callbacks/)."""

from cifar_amp.callbacks.precision_diagnostics import PrecisionDiagnostics

__all__ = ["PrecisionDiagnostics"]
