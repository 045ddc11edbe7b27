"""Extra (docs/fork.md, with predict; src/cifar_amp/extras/predict/README.md):
`python -m cifar_amp.extras.predict.export ckpt_path=<ckpt> format=onnx|torch_export [output=<file>]` exports
the network test evaluates (with its TTA; float32, CPU, dynamic batch), with data_meta inside
the file, verified on real images before it is written. Nothing in the core imports this."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from cifar_amp.checkpoints import Checkpoint
from cifar_amp.errors import UserError
from cifar_amp.extras.predict.prediction import (
    class_count,
    data_meta,
    load,
    logits,
    normaliser,
    read,
    tta_mode,
)

log = logging.getLogger("cifar_amp.extras.predict.export")  # not "__main__" under python -m

SUFFIXES = {"onnx": ".onnx", "torch_export": ".pt2"}
TRACE_BATCH = 2  # torch.export specialises sizes 0 and 1, so trace with 2 and verify others
DYNAMIC_BATCH = {"images": {0: torch.export.Dim("batch", min=1)}}
ENTRY = "the export"  # as an error names this command


@dataclass
class ExportConfig:
    """The top of `src/cifar_amp/extras/predict/configs/export.yaml`: export a checkpoint's network, verified on `input`."""

    run_dir: str = "${hydra:runtime.output_dir}"
    ckpt_path: Optional[str] = None  # required: the checkpoint to export
    format: str = "onnx"  # onnx | torch_export
    output: Optional[str] = None  # null: <run_dir>/model.onnx or model.pt2
    # Images to verify on (a folder, an image file, a CIFAR batch file); null: data_meta's
    # `test_images`, those the checkpoint's run tested on.
    input: Optional[str] = None
    verify_images: int = 64  # how many of them (at this batch size and at batch size 1)
    # Exported logits must be within atol + rtol * |PyTorch's| of the PyTorch module's.
    atol: float = 1e-4
    rtol: float = 1e-4
    tta: Optional[str] = None  # test-time augmentation built in; null: the checkpoint's
    trust_checkpoint: bool = False  # as in train.yaml


class EvalNet(nn.Module):
    """What test evaluates the module by (prediction.logits): images -> logits."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, images: Tensor) -> Tensor:
        return logits(self.module, images)


def export(cfg: DictConfig) -> dict[str, Any]:
    """Export, verify, then write `cfg.output` (default `<run_dir>/model.<onnx|pt2>`)."""
    if not cfg.ckpt_path:
        raise UserError(
            "ckpt_path is required, e.g. ckpt_path=<run>/checkpoints/best-epoch009.ckpt"
        )
    if cfg.format not in SUFFIXES:
        raise UserError(f"format={cfg.format} is not an option; valid: {', '.join(SUFFIXES)}")
    if cfg.verify_images < 1:
        raise UserError(
            f"invalid config value for verify_images: {cfg.verify_images}; must be >= 1"
        )
    ckpt = Checkpoint(cfg.ckpt_path, trust=cfg.trust_checkpoint)
    meta = data_meta(ckpt)
    module = load(ckpt, ENTRY, cfg.tta)
    n = class_count(module, meta, ENTRY)
    source = cfg.input or meta.get("test_images")
    give = (
        "the export is verified on real images: "
        "give input=<a folder of images, an image file or a CIFAR batch file>"
    )
    if source is None:
        raise UserError(
            f"ckpt_path={cfg.ckpt_path} does not say what data it was tested on; {give}"
        )
    if not Path(source).exists():
        what = f"input={source}" if cfg.input else f"the checkpoint's test images ({source})"
        raise UserError(f"{what}: no such file or folder; {give}")
    inputs = read(source, meta, n)
    if not inputs.names:
        raise UserError(f"none of the images in input={source} could be read")
    images = normaliser(meta)(inputs.images[: cfg.verify_images])
    # At least 3, so that both verified batch sizes differ from the traced one.
    images = images[torch.arange(max(len(images), 3)) % len(images)]
    net = EvalNet(module).eval()
    out = Path(cfg.output or Path(cfg.run_dir) / f"model{SUFFIXES[cfg.format]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    info = {
        **{k: v for k, v in meta.items() if k != "test_images"},  # a path of the training machine
        "class_names": meta.get("class_names") or [str(i) for i in range(n)],
        "input": "images: float32 (N, 3, H, W), (pixel / 255 - mean) / std",
        "output": "logits: (N, classes); softmax gives probabilities",
        "tta": tta_mode(module),
    }
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")  # torch.export.load wants the suffix
    try:
        with torch.no_grad():
            (to_onnx if cfg.format == "onnx" else to_torch_export)(net, images, tmp, info)
            diff = verify(cfg.format, tmp, net, images, cfg.atol, cfg.rtol)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log.info(
        f"Exported {cfg.format} to {out} ({out.stat().st_size / 1e6:.1f} MB, tta={tta_mode(module)}, "
        f"dynamic batch). Verified on {min(len(inputs.names), cfg.verify_images)} image(s) of "
        f"input={source} at batch sizes {len(images)} and 1: max |logit difference| "
        f"{diff:.2e} (tolerance {cfg.atol:g} + {cfg.rtol:g} * |logit|)"
    )
    return {"output": str(out), "max_abs_diff": diff}


def to_onnx(net: nn.Module, images: Tensor, path: Path, info: dict) -> None:
    # The dynamo exporter needs onnxscript, whose optimizer passes log each step at INFO.
    for name in ("onnxscript", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        program = torch.onnx.export(
            net,
            (images[:TRACE_BATCH],),
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=DYNAMIC_BATCH,
            dynamo=True,
            verbose=False,
        )
    except ImportError as e:
        raise UserError(
            f"format=onnx needs the export extra: pip install -e '.[export]' ({e})"
        ) from e
    program.model.metadata_props.update({k: json.dumps(v) for k, v in info.items()})
    program.save(path)


def to_torch_export(net: nn.Module, images: Tensor, path: Path, info: dict) -> None:
    program = torch.export.export(net, (images[:TRACE_BATCH],), dynamic_shapes=DYNAMIC_BATCH)
    torch.export.save(program, path, extra_files={"meta.json": json.dumps(info)})


def verify(fmt: str, path: Path, net: nn.Module, images: Tensor, atol: float, rtol: float) -> float:
    """Run the file at `path` as a deployment would, at batch sizes len(images) and 1; the
    largest |difference| from `net`'s logits. UserError where it exceeds the tolerance."""
    if fmt == "onnx":
        try:
            import onnxruntime
        except ImportError as e:
            raise UserError(
                "format=onnx is verified with onnxruntime: pip install -e '.[export]'"
            ) from e
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])

        def run(x: Tensor) -> Tensor:
            return torch.from_numpy(session.run(["logits"], {"images": x.numpy()})[0])
    else:
        run = torch.export.load(path).module()
    worst = 0.0
    for batch in (images, images[:1]):
        ours, theirs = net(batch), run(batch)
        if theirs.shape != ours.shape:
            raise UserError(
                f"the exported model gave shape {tuple(theirs.shape)} for {tuple(ours.shape)}: not written"
            )
        diff = (theirs - ours).abs()
        worst = max(worst, float(diff.max()))
        if not bool((diff <= atol + rtol * ours.abs()).all()):
            raise UserError(
                f"the exported {fmt} model's logits differ from PyTorch's by up to {worst:.2e} at "
                f"batch size {len(batch)}, beyond atol={atol:g} + rtol={rtol:g} * |logit|: not written"
            )
    return worst


def main(cfg: DictConfig) -> None:
    export(cfg)


if __name__ == "__main__":
    from cifar_amp import cli

    cli.main(main, "export", ExportConfig, entry=__spec__.name)  # as `python -m` names it
