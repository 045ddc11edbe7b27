"""The table of the network's layers at fit start: Lightning's, with the FLOPs of one image
(Lightning counts them only for a module's `example_input_array`) and without the rows of the
metrics (torchmetrics objects are modules of the LightningModule, with nothing to show)."""

import torch
from lightning.pytorch.callbacks import ModelSummary
from torchmetrics import Metric

from cifar_amp import seams


class LayerSummary(ModelSummary):
    """Lightning's ModelSummary (`max_depth`: the nesting shown) of the network, FLOPs per image."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.metrics = {n for n, m in pl_module.named_children() if isinstance(m, Metric)}
        dm = trainer.datamodule
        # Not a compiled network: a forward of one image would compile it for that batch size.
        eager = not pl_module.hparams.get("compile")
        if stage == "fit" and eager and isinstance(dm, seams.ImageData):
            if pl_module.example_input_array is None:
                pl_module.example_input_array = torch.zeros(1, *dm.image_shape)

    def summarize(self, summary_data, *totals, **kwargs) -> None:
        keep = [name not in self.metrics for name in dict(summary_data)["Name"]]
        rows = [
            (head, [v for v, k in zip(values, keep, strict=True) if k])
            for head, values in summary_data
        ]
        ModelSummary.summarize(rows, *totals, **kwargs)
