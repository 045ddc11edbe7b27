"""Data modules (each gets a config schema, `schema/data/<Name>`) and device-side batches."""

from cifar_amp.data.augment import Augment
from cifar_amp.data.cifar import SPECS, CIFARDataModule
from cifar_amp.data.device_batches import DeviceBatches
from cifar_amp.data.image_folder import ImageFolderDataModule

__all__ = ["Augment", "CIFARDataModule", "DeviceBatches", "ImageFolderDataModule", "SPECS"]
