"""The resnet18 extra: `model=resnet18`: torchvision's ResNet-18 for 32x32 images, activation
checkpointing by block or stage (the precision and memory lab's network)."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
