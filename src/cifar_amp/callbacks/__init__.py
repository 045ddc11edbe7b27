"""Lightning callbacks of the template (each one a piece of a recipe, switched on in YAML)."""

from cifar_amp.callbacks.whitening import PatchWhitening

__all__ = ["PatchWhitening"]
