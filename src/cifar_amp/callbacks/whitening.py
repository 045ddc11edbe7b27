"""Data-dependent initialisation of the first conv as a patch-whitening filter bank.

As in the public speed-run scripts: the k x k patches of the training images are decorrelated
by the eigenvectors of their covariance scaled by 1/sqrt(eigenvalue + eps), so the first layer
starts out (and, frozen, stays) a whitening transform; each filter also gets its negative so
that the following GELU loses no information. Unlike those scripts we centre the patches and
put the mean in the bias, so the layer's output is zero-mean with identity covariance.
"""

from __future__ import annotations

import logging

import torch
from lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn

from cifar_amp.errors import UserError

log = logging.getLogger(__name__)


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
