"""The core's data: CIFAR-10/100 resident on the training device, augmented there."""

from cifar_amp.data.augment import Augment
from cifar_amp.data.batches import DeviceBatches
from cifar_amp.data.cifar import SPECS, CIFARDataModule

__all__ = ["Augment", "CIFARDataModule", "DeviceBatches", "SPECS"]
