<<<<<<< HEAD
"""Lightning callbacks of the template (configs/callbacks/)."""

from cifar_amp.callbacks.precision_diagnostics import PrecisionDiagnostics

__all__ = ["PrecisionDiagnostics"]
=======
"""Lightning callbacks of the template (each one a piece of a recipe, switched on in YAML)."""

from cifar_amp.callbacks.whitening import PatchWhitening

__all__ = ["PatchWhitening"]
>>>>>>> speed
