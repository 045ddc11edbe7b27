"""Plain nn.Modules, chosen with `model=<name>` (configs/model/<name>.yaml)."""

from cifar_amp.models.resnet import ResNet18
from cifar_amp.models.small_cnn import SmallCNN
from cifar_amp.models.speednet import SpeedNet
from cifar_amp.models.timm_net import Timm

__all__ = ["ResNet18", "SmallCNN", "SpeedNet", "Timm"]
