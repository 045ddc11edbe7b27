from cifar_amp.data.cifar import SPECS, CIFARDataModule

__all__ = ["CIFARDataModule", "SPECS"]
