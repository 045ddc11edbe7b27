"""Extra (hparams_search=optuna): the search space for the machine the search runs on. A
precision mode the device runs in emulation is left out, by the core's rule (precision.native,
which precision=auto and the CPU recipes follow too): float16 on a CPU without AMX-FP16 (45x
slower than float32 on the maintainers' Sapphire Rapids), bfloat16 on a CPU without bfloat16
instructions (10x slower on an AVX2 CPU) and on a GPU without it (the guards extra refuses it
there). The log says so in one line when the search starts."""

from __future__ import annotations

import logging

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser

from cifar_amp.precision import native

log = logging.getLogger(__name__)
KEY = "precision"
FLOAT16, BFLOAT16 = ("16-mixed", "16-true"), ("bf16-mixed", "bf16-true")


def fast_here(params: dict[str, str], config) -> dict[str, str]:
    """`hydra.sweeper.restrict`: `params` (key -> Hydra sweep) without the precision modes that
    the device of `config.trainer.accelerator` emulates; a command line's own choice of
    precision is not touched (the sweeper puts it over these)."""
    sweep = params.get(KEY)
    device = _device(config.trainer.accelerator)
    override = OverridesParser.create().parse_override(f"{KEY}={sweep}") if sweep else None
    if override is None or device is None or not override.is_sweep_override():
        return params
    slow = emulated(device)
    choices = [str(c) for c in override.sweep_iterator()]
    keep = [c for c in choices if c not in slow]
    if not keep or keep == choices:
        return params
    dropped = [c for c in choices if c in slow]
    why = "; ".join(sorted({slow[c] for c in dropped}))
    log.warning(
        f"Not searching {KEY} {', '.join(dropped)}: {why}. Searching {', '.join(keep)} "
        f"(to search it anyway, give {KEY}='choice(...)' on the command line)"
    )
    return params | {KEY: f"choice({', '.join(keep)})" if len(keep) > 1 else keep[0]}


def emulated(device: str) -> dict[str, str]:
    """mode -> why, for the modes a `device` ("cpu" or "cuda") of this machine emulates."""
    bf16, fp16 = native(device)
    name = "CPU" if device == "cpu" else torch.cuda.get_device_name()
    kinds, modes = [], []
    if not fp16:
        kinds.append("float16")
        modes += FLOAT16
    if not bf16:
        kinds.append("bfloat16")
        modes += BFLOAT16
    why = f"this machine's {name} emulates {' and '.join(kinds)}, many times slower than 32-true"
    return dict.fromkeys(modes, why)


def _device(accelerator) -> str | None:
    """The device type jobs of `accelerator` train on, where known: "cpu" or "cuda"."""
    if accelerator in (None, "auto"):
        if torch.cuda.is_available():
            return "cuda"
        return None if torch.backends.mps.is_available() else "cpu"
    device = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}.get(str(accelerator))
    return None if device == "cuda" and not torch.cuda.is_available() else device
