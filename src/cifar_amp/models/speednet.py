import torch
from torch import Tensor, nn

from cifar_amp.models.checkpointing import Chain, recomputed, run_blocks
from cifar_amp.models.pooling import GlobalPool


class SpeedNet(nn.Module):
    """The speed-run scripts' net (about 2M parameters); its stem is block 0, in stage 0."""

    def __init__(
        self,
        num_classes: int = 10,
        widths: tuple[int, ...] = (64, 256, 256),
        stem_width: int = 24,  # 2 x (3 x 2 x 2) patch dimensions: whitening needs >= 12
        bn_momentum: float = 0.4,  # torch convention (weight of the new batch)
        logit_scale: float = 1 / 9,  # scaled-down logits train faster with high learning rates
        activation_checkpointing: int = 0,  # recompute every k-th block in backward; 0 = off
        checkpoint_stages: tuple[int, ...] = (),  # or every block of these stages, e.g. [0]
    ):
        super().__init__()
        stages = (2, *[1] * (len(widths) - 1))
        self.recompute = recomputed(stages, activation_checkpointing, checkpoint_stages)
        self.stem = nn.Conv2d(3, stem_width, kernel_size=2, padding=0, bias=True)
        chans = (stem_width, *widths)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.MaxPool2d(2),
                nn.BatchNorm2d(c_out, momentum=bn_momentum),
                nn.GELU(),
                nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out, momentum=bn_momentum),
                nn.GELU(),
            )
            for c_in, c_out in zip(chans, chans[1:], strict=False)
        )
        self.pool = GlobalPool(nn.AdaptiveMaxPool2d(1), torch.amax)
        self.head = nn.Linear(chans[-1], num_classes, bias=False)
        self.logit_scale = logit_scale

    def forward(self, x: Tensor) -> Tensor:
        x = run_blocks([Chain(self.stem, nn.functional.gelu), *self.blocks], x, self.recompute)
        return self.head(self.pool(x).flatten(1)) * self.logit_scale
