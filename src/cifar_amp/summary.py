"""The table of the network's layers at fit start: Lightning's, with the FLOPs of one image
(Lightning counts them only for a module's `example_input_array`) and without the rows of the
metrics (torchmetrics objects are modules of the LightningModule, with nothing to show)."""

import torch
from lightning import LightningModule
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import summarize
from torchmetrics import Metric

from cifar_amp import seams


class LayerSummary(ModelSummary):
    """Lightning's ModelSummary (`max_depth`: the nesting shown) of the network, FLOPs per image."""

    def __init__(self, max_depth: int = 1) -> None:
        super().__init__(max_depth=max_depth)
        self.depth = max_depth

    def on_fit_start(self, trainer, pl_module) -> None:
        if not self.depth or not trainer.is_global_zero:
            return
        # Not a compiled network: a forward of one image would compile it for that batch size.
        eager = not pl_module.hparams.get("compile")
        dm = trainer.datamodule
        image = None
        if eager and isinstance(dm, seams.ImageData):
            image = torch.zeros(1, *dm.image_shape, device=pl_module.device)
        layers = Layers(pl_module, image, trainer.precision_plugin)
        rank_zero_info(f"\n{summarize(layers, max_depth=self.depth)}")


class Layers(LightningModule):
    """What the table shows: the module's layers but its metrics, fed one image. Its own module,
    not the run's: Lightning passes a module's example input through the DataModule's batch
    hooks (`on_after_batch_transfer`) as if it were a batch, which a DataModule that unpacks
    (images, labels) there cannot take. Without a Trainer, Lightning calls this module's own
    hooks, which leave a tensor as it is."""

    def __init__(self, module: LightningModule, image, precision_plugin) -> None:
        super().__init__()
        for name, child in module.named_children():
            if not isinstance(child, Metric):
                self.add_module(name, child)
        # Plain attributes: registered as a child, the module would be counted in the table.
        self.__dict__["run_module"] = module
        self.__dict__["precision_plugin"] = precision_plugin
        self.example_input_array = image
        self.to(module.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # forward, not a call: torch's FLOP counter names a layer by the first module entered
        # (`Layers.net`), which Lightning's table looks up.
        with self.precision_plugin.forward_context():
            return self.run_module.forward(self.precision_plugin.convert_input(x))
