import torch
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, ResNet

from cifar_amp.models.checkpointing import check_every, run_blocks


class ResNet18(ResNet):
    """torchvision's ResNet-18 adapted to 32x32 inputs: 3x3 stride-1 stem, no max-pool."""

    def __init__(self, num_classes: int = 10, activation_checkpointing: int = 0):
        super().__init__(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.maxpool = nn.Identity()
        self.checkpoint_every = check_every(activation_checkpointing)

    @property
    def blocks(self) -> list[nn.Module]:
        return [*self.layer1, *self.layer2, *self.layer3, *self.layer4]

    def _forward_impl(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = run_blocks(self.blocks, x, self.checkpoint_every)
        return self.fc(torch.flatten(self.avgpool(x), 1))
