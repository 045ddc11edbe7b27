"""Any network of timm (PyTorch Image Models), sized for the data's classes."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path

from torch import nn

from cifar_amp.errors import InvalidArgument, UserError

log = logging.getLogger(__name__)


# A function named like a class: its name is the schema's (`schema/model/Timm`), and it
# returns timm's own network, so state-dict keys are timm's (its weight files fit them).
def Timm(
    name: str = "resnet18",  # any name of timm.list_models(), e.g. resnet50, convnext_tiny
    num_classes: int = 10,
    pretrained: bool = False,  # ImageNet weights from the Hugging Face hub (needs network)
    # A local weights file instead (.safetensors, .pth, .bin: a state dict of this network);
    # the head is re-sized for num_classes as with hub weights.
    pretrained_path: str | None = None,
    activation_checkpointing: int = 0,  # > 0: timm's own gradient checkpointing, every block
    drop_rate: float | None = None,  # dropout before the classifier; null = timm's default
    kwargs: dict | None = None,  # any other timm.create_model argument, e.g. {img_size: 64}
) -> nn.Module:
    import timm  # here: importing timm takes seconds, and only this model needs it

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see timm.list_models()"
        raise InvalidArgument("name", repr(name), f"not a timm model; {hint}")
    if activation_checkpointing < 0:
        raise InvalidArgument("activation_checkpointing", activation_checkpointing, "must be >= 0")
    args = {"num_classes": num_classes, "drop_rate": drop_rate, **(kwargs or {})}
    if pretrained_path is not None:
        if not Path(pretrained_path).is_file():
            raise InvalidArgument("pretrained_path", pretrained_path, "no such file")
        args.update(pretrained=True, pretrained_cfg_overlay={"file": str(pretrained_path)})
    elif pretrained:
        if not timm.models.is_model_pretrained(name):
            raise InvalidArgument("pretrained", "true", f"timm has no weights for {name}")
        args["pretrained"] = True
    try:
        net = timm.create_model(name, **args)
    except Exception as e:
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        if pretrained_path is not None:
            raise InvalidArgument(
                "pretrained_path", pretrained_path, f"not for {name}: {why}"
            ) from e
        if pretrained:
            raise UserError(
                f"model.pretrained=true: cannot fetch {name}'s weights ({type(e).__name__}); "
                "without network, download them elsewhere and set model.pretrained_path=<file>"
            ) from e
        raise InvalidArgument("kwargs", kwargs, why) from e
    if activation_checkpointing:
        try:
            net.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError) as e:
            raise InvalidArgument(
                "activation_checkpointing", activation_checkpointing, f"{name} lacks it"
            ) from e
    if args.get("pretrained"):
        cfg = net.pretrained_cfg
        size = "x".join(map(str, cfg.get("input_size", ())[1:])) or "?"
        log.info(
            f"timm {name}: pretrained on {size} images normalised with mean {cfg.get('mean')}, "
            f"std {cfg.get('std')} (data.mean, data.std should match)"
        )
    return net
