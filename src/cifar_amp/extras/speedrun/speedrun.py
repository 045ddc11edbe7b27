"""Extra (docs/fork.md): the speed-run recipe's callbacks, for `experiment=speedrun` and
`experiment=speedrun_gpu`. Nothing in the core imports this module."""

from __future__ import annotations

import logging

import torch
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from cifar_amp.errors import UserError
from cifar_amp.extras.speedrun import compat
from cifar_amp.seams import ModelStateCopy

log = logging.getLogger(__name__)


class EMA(EMAWeightAveraging, ModelStateCopy):
    """Lightning's `EMAWeightAveraging` (same arguments, updates and checkpoint contents),
    updated without reading the device: the parent's `AveragedModel.update_parameters` reads
    the update count on the host twice per call and averages tensor by tensor. Here the count
    is read once per fit, and the average is one `_foreach_lerp_`."""

    model_state_key = "current_model_state"  # the parent's: the trained weights, beside the average

    def __init__(self, *args, decay: float = 0.999, **kwargs) -> None:
        super().__init__(*args, decay=decay, **kwargs)
        self._lerp = get_ema_multi_avg_fn(decay)
        self._pairs: tuple | None = None  # see _split
        self._started = False  # the average holds weights (n_averaged > 0)
        self._trained: dict | None = None  # the module's own weights, once fit has ended

    @property
    def state_key(self) -> str:
        # The parent's key, so checkpoints of either class resume with the other.
        return EMAWeightAveraging.__qualname__

    def on_train_start(self, trainer, pl_module) -> None:
        # After a resume has restored n_averaged: the one host read of the fit.
        self._started = bool(compat.average_model(self).n_averaged > 0)
        self._pairs = None
        self._trained = None

    def on_train_end(self, trainer, pl_module) -> None:
        # The parent puts the average into the module; a last.ckpt written after this must
        # still hold the trained weights, or a resume that trains longer goes on from the average.
        self._trained = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._trained is not None and self.model_state_key in checkpoint:
            checkpoint[self.model_state_key] = self._trained

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Only a fit goes on from the trained weights; a test evaluates the checkpoint's
        # `state_dict`, the average, as eval.py does (the parent would load the trained ones).
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":  # the parent's hooks, on its schedule, update through ours
            compat.average_model(self).update_parameters = self._update

    @torch.no_grad()
    def _update(self, pl_module) -> None:
        average = compat.average_model(self)
        if self._pairs is None:  # the same tensors all fit long
            self._pairs = self._split(average.module, pl_module)
        avg, cur, avg_copy, cur_copy = self._pairs
        if not self._started:  # the first update starts the average at the weights
            avg_copy, cur_copy = avg + avg_copy, cur + cur_copy
            self._started = True
        elif avg:
            self._lerp(avg, self._moved(avg, cur), None)
        if avg_copy:
            compat.copy_all(avg_copy, self._moved(avg_copy, cur_copy))
        average.n_averaged += 1

    def _moved(self, average: list, current: list) -> list:
        # `device=` keeps the average elsewhere (e.g. "cpu"): then each update copies, and waits.
        if compat.averaging_settings(self)[0] is None:
            return current
        return [c.to(a.device) for a, c in zip(average, current, strict=True)]

    def _split(self, average: torch.nn.Module, model: torch.nn.Module) -> tuple[list, ...]:
        """(averaged, their sources, copied, their sources): as AveragedModel, buffers are copied
        unless `use_buffers`, and integer ones (BatchNorm's batch counter) always."""
        params = list(zip(average.parameters(), model.parameters(), strict=True))
        buffers = list(zip(average.buffers(), model.buffers(), strict=True))
        use_buffers = compat.averaging_settings(self)[1]
        averaged = params + buffers if use_buffers else params
        lerp = [(a.detach(), c.detach()) for a, c in averaged if a.is_floating_point()]
        copy = [(a.detach(), c.detach()) for a, c in params + buffers if not a.is_floating_point()]
        if not use_buffers:
            copy += [(a.detach(), c.detach()) for a, c in buffers if a.is_floating_point()]
        return tuple([pair[i] for pair in group] for group in (lerp, copy) for i in (0, 1))


# -- patch whitening: the first conv starts as (and, frozen, stays) a whitening transform of
# the training images' k x k patches, as in the public speed-run scripts; each filter also gets
# its negative so that the GELU after it loses nothing. Unlike those scripts the patches are
# centred (the mean goes in the bias).
def patches(x: Tensor, kh: int, kw: int) -> Tensor:
    """All kh x kw patches (stride 1, no padding) of `x` (N, C, H, W) as rows (M, C*kh*kw),
    flattened in the order of a conv weight (C, kh, kw)."""
    c = x.shape[1]
    p = x.unfold(2, kh, 1).unfold(3, kw, 1)  # (N, C, H', W', kh, kw)
    return p.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * kh * kw)


def whitening_weights(
    x: Tensor, kh: int, kw: int, eps: float, chunk: int = 512
) -> tuple[Tensor, Tensor]:
    """(W, b) with W (d, C, kh, kw), d = C*kh*kw, such that conv(x, W) + b has zero mean and about
    identity covariance over the patches of `x`; float64 sums by chunks bound the memory."""
    d = x.shape[1] * kh * kw
    total = torch.zeros(d, dtype=torch.float64)
    outer = torch.zeros(d, d, dtype=torch.float64)
    count = 0
    for part in x.split(chunk):
        p = patches(part.float(), kh, kw)
        count += len(p)
        total += p.sum(0).double().cpu()
        outer += (p.T @ p).double().cpu()
    mean = total / count
    cov = outer / count - torch.outer(mean, mean)
    eigval, eigvec = torch.linalg.eigh(cov)
    w = eigvec.T / torch.sqrt(eigval.clamp_min(0) + eps)[:, None]  # rows: whitening filters
    w = w.flip(0)  # largest-variance directions first, so a narrower stem keeps those
    return w.reshape(d, -1, kh, kw).float(), (-w @ mean).float()


class PatchWhitening(Callback):
    """When fit starts, set `layer` (a Conv2d with d to 2d outputs, d = in_channels * kernel
    area) to [W, -W] whitening filters of the first `num_images` training images. `freeze`
    keeps its weights (not its bias) fixed. A resume keeps the checkpoint's layer."""

    def __init__(
        self,
        layer: str = "net.stem",
        num_images: int = 5000,
        eps: float = 5e-4,
        freeze: bool = True,
    ):
        if num_images < 1 or eps < 0:
            raise UserError(
                f"PatchWhitening: num_images must be >= 1 and eps >= 0 (got {num_images}, {eps})"
            )
        self.layer, self.num_images, self.eps, self.freeze = layer, num_images, eps, freeze

    def conv(self, pl_module: LightningModule) -> nn.Conv2d:
        try:
            conv = pl_module.get_submodule(self.layer)
        except AttributeError:
            conv = None
        if not isinstance(conv, nn.Conv2d) or conv.bias is None or conv.groups != 1:
            raise UserError(
                f"PatchWhitening: layer={self.layer!r} is not a Conv2d with a bias in this model"
            )
        d = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
        if not d <= conv.out_channels <= 2 * d:
            raise UserError(
                f"PatchWhitening: {self.layer} has {conv.out_channels} output channels; "
                f"whitening its {d}-dimensional patches needs between {d} and {2 * d}"
            )
        return conv

    @torch.no_grad()
    def initialise(self, conv: nn.Conv2d, images: Tensor) -> None:
        """Set `conv` from `images`, normalised float (N, C, H, W) as the network sees them."""
        w, b = whitening_weights(images, *conv.kernel_size, eps=self.eps)
        n = conv.out_channels
        conv.weight.copy_(torch.cat([w, -w])[:n])
        conv.bias.copy_(torch.cat([b, -b])[:n])

    # `setup`, not `on_fit_start`: the datamodule is set up by then, and freezing must come
    # before DDP wraps the model (it registers the parameters that need gradients).
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        conv = self.conv(pl_module)
        if trainer.ckpt_path is None:
            dm = trainer.datamodule
            loader = dm.train_dataloader() if dm is not None else None
            if not all(hasattr(loader, a) for a in ("images", "mean", "std")):
                raise UserError(
                    "PatchWhitening needs the template's CIFARDataModule (device-resident images)"
                )
            x = (loader.images[: self.num_images].float() - loader.mean) / loader.std
            self.initialise(conv, x)
            log.info("PatchWhitening: %s initialised from %d training images", self.layer, len(x))
        if self.freeze:
            conv.weight.requires_grad_(False)
