"""The `precision` group's object: the Trainer's precision plugin (16-mixed's with its GradScaler),
then the layout and TF32 of the device the Trainer chose."""

import logging
import weakref
from typing import Annotated, Optional

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType

from cifar_amp import compat, metrics, seams
from cifar_amp.config import Nested
from cifar_amp.errors import InvalidArgument

log = logging.getLogger(__name__)
NAMES = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")


class Precision(seams.PrecisionMode):
    """One fixed mode for every step, with its plugin (16-mixed's with `scaler`) and layout."""

    def __init__(
        self,
        name: str = "32-true",  # Lightning's; 16-mixed is float16 + GradScaler on CPU too
        # torch.amp.GradScaler's arguments (defaults: torch's); 16-mixed only
        scaler: Annotated[Optional[dict], Nested(torch.amp.GradScaler, ("device",))] = None,
        channels_last: Optional[bool] = None,  # NHWC network and batches; null: channels_last_on
        tf32: bool = True,  # float32 convolutions and matmuls on TF32 cores; false: strict IEEE
        # The mode to train in instead where the device only emulates `name`'s 16-bit type
        # (`native`: a CPU without bfloat16 instructions runs bf16-mixed about 10x slower than
        # 32-true), e.g. 32-true; null: `name` on every device.
        where_emulated: Optional[str] = None,
    ) -> None:
        for arg, value in (("name", name), ("where_emulated", where_emulated or name)):
            if value not in NAMES:
                raise InvalidArgument(arg, repr(value), f"valid: {', '.join(NAMES)}")
        self.name, self.tf32, self.channels_last_setting = name, tf32, channels_last
        self.where_emulated = where_emulated
        self.asked: str | None = None  # `name` as configured, where the device emulates it
        self.channels_last: bool | None = None  # on the Trainer's device: decided by setup()
        self.scaler = s = dict(scaler or {})  # what it leaves out is torch's default
        for key, ok, rule in (
            ("init_scale", lambda v: v > 0, "must be > 0"),
            ("growth_factor", lambda v: v > 1, "must be > 1"),
            ("backoff_factor", lambda v: 0 < v < 1, "must be in (0, 1)"),
            ("growth_interval", lambda v: v >= 1, "must be >= 1"),
        ):
            if key in s and not ok(s[key]):
                raise InvalidArgument(f"scaler.{key}", s[key], rule)

    def settle(self, accelerator, resumes: str | None = None) -> None:
        """`where_emulated` instead of `name` where `accelerator`'s device emulates `name`,
        unless the run this one `resumes` trained in `name` (a run goes on as it began)."""
        if self.where_emulated and self.name not in (self.where_emulated, resumes):
            if emulated(self.name, compat.accelerator_device(accelerator)):
                self.asked = self.name
                self.name = self.where_emulated

    def trainer_args(self, accelerator, strategy) -> dict:
        """Under 16-mixed and bf16-mixed our plugin (16-mixed: with `scaler`, which Lightning's
        would drop; both: fused optimizers clipped); else `precision`, for Lightning to make."""
        if not self.autocasts:
            return {"precision": self.name}
        device = compat.accelerator_device(accelerator)  # autocast's, as Lightning picks it
        if isinstance(strategy, seams.StrategyWithFloat16Plugin):
            if self.name != "16-mixed":
                return {"precision": self.name}
            return {"plugins": [strategy.float16_plugin(self.scaler, device)]}
        return {"plugins": [self.plugin(device)]}

    @property
    def autocasts(self) -> bool:
        return self.name in ("16-mixed", "bf16-mixed")

    def channels_last_on(self, device: str) -> bool:
        """Unless set, the faster layout: on CUDA with tensor cores (32-true+TF32: 1.57x NCHW's
        speed, H100, ResNet-18 batch 512; strict fp32: 1.4% slower); on CPU all but float16."""
        if self.channels_last_setting is not None:
            return self.channels_last_setting
        if device == "cpu":
            return not self.name.startswith("16")
        return device == "cuda" and ("16" in self.name or (self.name == "32-true" and self.tf32))

    def record(self) -> dict:  # what metrics.json says of the precision
        return {metrics.PRECISION: self.name}

    def setup(self, trainer) -> None:
        """For the device the Trainer chose: TF32, the layout, a log line."""
        device = trainer.strategy.root_device
        if device.type == "cuda":  # process-wide switches that only CUDA reads
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = self.tf32
        self.channels_last = self.channels_last_on(device.type)
        tf32 = f", TF32 {'on' if self.tf32 else 'off'}" if device.type == "cuda" else ""
        layout = "channels_last" if self.channels_last else "NCHW"
        why = ""
        if self.asked:
            kind = "bfloat16" if self.asked.startswith("bf16") else "float16"
            why = f" ({self.asked} asked: this {device.type.upper()} emulates {kind}; "
            why += "precision.where_emulated=null trains in it all the same)"
        elif self.where_emulated and self.where_emulated != self.name:
            why = f" (native here; {self.where_emulated} where emulated)"
        log.info(f"Precision: {self.name}{why}, layout {layout}{tf32}")

    def plugin(self, device: str, name: str | None = None) -> MixedPrecision:
        """The autocast plugin of mode `name` (default: this one's), 16-mixed or bf16-mixed."""
        name = name or self.name
        scaler = torch.amp.GradScaler(device, **self.scaler) if name == "16-mixed" else None
        return Autocast(name, device, scaler)


def native(device_type: str) -> tuple[bool, bool]:
    """(bfloat16, float16): whether a device of this type here runs each natively, not in an
    emulation many times slower than float32. CUDA: bfloat16 from Ampere on; CPU: oneDNN's test
    (bfloat16: AVX512-BF16 or AMX), float16 only with AMX-FP16 as well (compat.amx_fp16: with
    AVX512-FP16 alone, float16 training steps ran 45x slower than 32-true); MPS: float16."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False), True
    if device_type == "cpu":
        fp16 = compat.onednn_native(torch.float16) and compat.amx_fp16()
        return compat.onednn_native(torch.bfloat16), fp16
    return False, device_type == "mps"


def emulated(name: str, device_type: str) -> bool:
    """Whether mode `name` computes in a 16-bit type that a `device_type` device emulates."""
    bf16, fp16 = native(device_type)
    return (name.startswith("bf16") and not bf16) or (name.startswith("16") and not fp16)


class Autocast(MixedPrecision):
    """Lightning's MixedPrecision, which also clips a fused optimizer's gradients. A 16-mixed
    step in order (Lightning's MixedPrecision.optimizer_step): backward of the scaled loss;
    `scaler.unscale_` unless the optimizer is fused; the on_before_optimizer_step hooks;
    clipping (below); `scaler.step`, skipped on inf/nan; `scaler.update`. Lightning refuses to
    clip for a fused optimizer, which unscales inside its step; since torch 2.1 (pytorch#94060)
    a fused step after `unscale_` takes only the inf flag, on the device. So clipping unscales
    first, and the step never waits for the device, where a foreach optimizer's `scaler.step`
    reads the flag on the host every step. Under bf16-mixed there is nothing to unscale, and
    Lightning refuses all the same."""

    # Checkpoints keep the GradScaler's state under the plugin's qualified name, so Lightning's
    # here lets a resume restore it whichever of the two plugins wrote it.
    __qualname__ = MixedPrecision.__qualname__

    # Where the norm of each clipping by norm goes, once a list is put here (the diagnostics
    # extra): the step then computes the gradients' norm once, not a second time to report it.
    clip_norms: list[torch.Tensor] | None = None

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        norm = torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)
        if self.clip_norms is not None:
            self.clip_norms.append(norm)

    def clip_gradients(
        self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM
    ):
        if (
            clip_val > 0
            and self.scaler is not None
            and compat.optimizer_handles_unscaling(optimizer)
        ):
            self.scaler.unscale_(optimizer)
        super(MixedPrecision, self).clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if self.scaler is not None and compat.optimizer_handles_unscaling(optimizer):
            start_momentum(optimizer)
        return super().optimizer_step(optimizer, model, closure, **kwargs)


_STARTED = weakref.WeakKeyDictionary()  # optimizer -> its param groups when momentum started


def start_momentum(optimizer) -> None:
    """torch's fused SGD makes its momentum buffers with `empty_like` at its first step, and
    leaves them unset when the GradScaler skips that step (an overflow, routine at float16's
    first steps): the next step reads whatever the memory held. Zeros instead, once, which with
    no dampening is the first step's own buffer: momentum * 0 + gradient."""
    groups = len(optimizer.param_groups)  # fine-tuning may add one later
    if not isinstance(optimizer, torch.optim.SGD) or _STARTED.get(optimizer) == groups:
        return
    for group in optimizer.param_groups:
        if group["momentum"] and not group["dampening"]:
            for p in group["params"]:
                state = optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p)
    _STARTED[optimizer] = groups
