"""The worked example of docs/fork.md: a user's own DataModule, plugged in by one YAML file.

Random images from torchvision's FakeData, served by a plain DataLoader. All the template
asks of a DataModule is Lightning's interface plus `num_classes` (the model's output size).
"""

import lightning as L
import torch
from torch.utils.data import DataLoader
from torchvision.datasets import FakeData
from torchvision.transforms import v2


class NoiseDataModule(L.LightningDataModule):
    def __init__(self, num_classes: int = 10, size: int = 256, batch_size: int = 32, seed: int = 0):
        super().__init__()
        self.num_classes, self.size, self.batch_size, self.seed = (
            num_classes,
            size,
            batch_size,
            seed,
        )
        self.transform = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])

    def _loader(self, offset: int) -> DataLoader:
        data = FakeData(
            self.size,
            (3, 32, 32),
            self.num_classes,
            self.transform,
            random_offset=self.seed + offset,
        )
        return DataLoader(data, batch_size=self.batch_size, shuffle=offset == 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(1)

    def test_dataloader(self) -> DataLoader:
        return self._loader(2)
