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

log = logging.getLogger(__name__)


class EMA(EMAWeightAveraging):
    """Lightning's `EMAWeightAveraging` (same arguments, same schedule of updates, same
    checkpoint contents: the average in `state_dict`, the raw weights in
    `current_model_state`), updated without reading the device.

    Why not the parent's update: it calls `AveragedModel.update_parameters`, which reads the
    update count on the host twice per call (`bool(n_averaged == 0)`, `if n_averaged > 0`), each
    a device sync, and averages tensor by tensor in Python. Here whether the average holds
    weights yet is known on the host (read once per fit), the floating-point tensors are
    averaged by torch's `get_ema_multi_avg_fn` (one `_foreach_lerp_`), integer buffers
    (BatchNorm's batch counter) are copied, and the count is incremented on the device.
    """

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
        self._started = bool(self._average_model.n_averaged > 0)
        self._pairs = None
        self._trained = None

    def on_train_end(self, trainer, pl_module) -> None:
        # The parent puts the average into the module. A checkpoint written after this (the
        # step checkpointer's final last.ckpt) must still hold the trained weights as
        # `current_model_state`, or a resume that trains longer would go on from the average.
        self._trained = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        super().on_train_end(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._trained is not None and "current_model_state" in checkpoint:
            checkpoint["current_model_state"] = self._trained

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Only a fit goes on from the trained weights. A test or validation of a checkpoint
        # (the best one, after fit) evaluates its `state_dict`, the average, as eval.py does;
        # the parent would load the trained weights whenever it has an average model.
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # The parent's rule: step_idx is zero-based, one update per optimizer step.
        if trainer.global_step > self._latest_update_step and self.should_update(
            step_idx=trainer.global_step - 1
        ):
            self._update(pl_module)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch > self._latest_update_epoch and self.should_update(
            epoch_idx=trainer.current_epoch
        ):
            self._update(pl_module)
            self._latest_update_epoch = trainer.current_epoch

    @torch.no_grad()
    def _update(self, pl_module) -> None:
        average = self._average_model
        if self._pairs is None:  # the same tensors all fit long
            self._pairs = self._split(average.module, pl_module)
        avg, cur, avg_copy, cur_copy = self._pairs
        if not self._started:  # the first update starts the average at the weights
            avg_copy, cur_copy = avg + avg_copy, cur + cur_copy
            self._started = True
        elif avg:
            self._lerp(avg, self._moved(avg, cur), None)
        if avg_copy:
            torch._foreach_copy_(avg_copy, self._moved(avg_copy, cur_copy))
        average.n_averaged += 1

    def _moved(self, average: list, current: list) -> list:
        # `device=` keeps the average elsewhere (e.g. "cpu"): then each update copies, and waits.
        if self._device is None:
            return current
        return [c.to(a.device) for a, c in zip(average, current, strict=True)]

    def _split(self, average: torch.nn.Module, model: torch.nn.Module) -> tuple[list, ...]:
        """(averaged, their sources, copied, their sources): floating-point parameters (and
        buffers, with `use_buffers`) are averaged; integer buffers (BatchNorm's batch
        counter), and all buffers without `use_buffers` (as AveragedModel does), are copied."""
        params = list(zip(average.parameters(), model.parameters(), strict=True))
        buffers = list(zip(average.buffers(), model.buffers(), strict=True))
        averaged = params + buffers if self._use_buffers else params
        lerp = [(a.detach(), c.detach()) for a, c in averaged if a.is_floating_point()]
        copy = [(a.detach(), c.detach()) for a, c in params + buffers if not a.is_floating_point()]
        if not self._use_buffers:
            copy += [(a.detach(), c.detach()) for a, c in buffers if a.is_floating_point()]
        return tuple([pair[i] for pair in group] for group in (lerp, copy) for i in (0, 1))


# -- patch whitening ----------------------------------------------------------------------
# Data-dependent initialisation of the first conv as a patch-whitening filter bank.
#
# As in the public speed-run scripts: the k x k patches of the training images are decorrelated
# by the eigenvectors of their covariance scaled by 1/sqrt(eigenvalue + eps), so the first layer
# starts out (and, frozen, stays) a whitening transform; each filter also gets its negative so
# that the following GELU loses no information. Unlike those scripts we centre the patches and
# put the mean in the bias, so the layer's output is zero-mean with identity covariance.


def patches(x: Tensor, kh: int, kw: int) -> Tensor:
    """All kh x kw patches (stride 1, no padding) of `x` (N, C, H, W) as rows (M, C*kh*kw),
    flattened in the order of a conv weight (C, kh, kw)."""
    c = x.shape[1]
    p = x.unfold(2, kh, 1).unfold(3, kw, 1)  # (N, C, H', W', kh, kw)
    return p.permute(0, 2, 3, 1, 4, 5).reshape(-1, c * kh * kw)


def whitening_weights(
    x: Tensor, kh: int, kw: int, eps: float, chunk: int = 512
) -> tuple[Tensor, Tensor]:
    """(W, b) with W (d, C, kh, kw) such that conv(x, W) + b has zero mean and about identity
    covariance over the patches of `x`; d = C*kh*kw. Accumulated in float64 by chunks of images
    so that memory stays bounded on any device."""
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
    """When fit starts, set `layer` (a Conv2d of the LightningModule) to [W, -W] whitening
    filters computed from the first `num_images` training images of the datamodule.

    The layer needs between d and 2d output channels (d = in_channels * kernel area: 12 for
    a 2x2 conv on RGB). `freeze` keeps its weights fixed (its bias still trains), as the
    speed-run scripts do. Not re-run when resuming: the checkpoint holds the layer.
    """

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
            loader = (
                trainer.datamodule.train_dataloader() if trainer.datamodule is not None else None
            )
            if not all(hasattr(loader, a) for a in ("images", "mean", "std")):
                raise UserError(
                    "PatchWhitening needs the template's CIFARDataModule (device-resident images)"
                )
            x = (loader.images[: self.num_images].float() - loader.mean) / loader.std
            self.initialise(conv, x)
            log.info("PatchWhitening: %s initialised from %d training images", self.layer, len(x))
        if self.freeze:
            conv.weight.requires_grad_(False)
