from torch import Tensor, nn

from cifar_amp.models.checkpointing import recomputed, run_blocks


class SmallCNN(nn.Module):
    """The AMP tutorial's network: two conv + pool stages, two linear layers on an 8x8 map."""

    def __init__(
        self,
        num_classes: int = 10,
        width: int = 32,
        hidden: int = 256,
        activation_checkpointing: int = 0,  # recompute every k-th block in backward; 0 = off
        checkpoint_stages: tuple[int, ...] = (),  # or every block of these stages: [0] or [1]
    ):
        super().__init__()
        self.recompute = recomputed((1, 1), activation_checkpointing, checkpoint_stages)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
            for a, b in ((3, width), (width, 2 * width))
        )
        self.pool = nn.AdaptiveAvgPool2d(8)  # apart from `head`, whose keys checkpoints name
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * 8 * 8, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(run_blocks(self.blocks, x, self.recompute)))
