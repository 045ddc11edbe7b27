import torch
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, ResNet

from cifar_amp.models.checkpointing import Chain, recomputed, run_blocks
from cifar_amp.models.pooling import GlobalPool


class ResNet18(ResNet):
    """torchvision's ResNet-18 adapted to 32x32 inputs: 3x3 stride-1 stem, no max-pool. Blocks,
    for activation checkpointing: the stem, then the 8 residual blocks. Stages: 0 = the stem and
    layer1 (32x32, about half the activations), 1 = layer2 (16x16), 2 = layer3, 3 = layer4."""

    def __init__(
        self,
        num_classes: int = 10,
        activation_checkpointing: int = 0,  # recompute every k-th block in backward; 0 = off
        checkpoint_stages: tuple[int, ...] = (),  # or every block of these stages, e.g. [0, 1]
    ):
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.maxpool = nn.Identity()
        self.avgpool = GlobalPool(nn.AdaptiveAvgPool2d(1), torch.mean)
        self.recompute = recomputed((3, 2, 2, 2), activation_checkpointing, checkpoint_stages)

    def forward(self, x: Tensor) -> Tensor:
        stem = Chain(self.conv1, self.bn1, self.relu)
        blocks = [stem, *self.layer1, *self.layer2, *self.layer3, *self.layer4]
        return self.fc(torch.flatten(self.avgpool(run_blocks(blocks, x, self.recompute)), 1))
