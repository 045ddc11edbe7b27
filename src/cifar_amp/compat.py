"""Every private name of Lightning and torch that the core uses, in one place: where a release
renames or changes one, the test named beside it fails, and this is the one file to mend. Each
entry is one line, `# <the private names>: why no public API serves. Fails: <test>`; the table
in docs/reliability.md is made from these lines (`python scripts/compat_table.py`). An extra that
needs private names of its own keeps them in a compat.py of its folder, in the same form."""

from __future__ import annotations

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from torch import nn


# _optimizer_handles_unscaling (lightning.fabric.plugins.precision.amp): Lightning's own test of whether an optimizer (fused Adam, AdamW, SGD) unscales in its step, so that the 16-mixed plugin skips its unscale_. Fails: tests/test_optimizers.py::test_fused_optimizers_handle_unscaling_and_foreach_ones_do_not
def optimizer_handles_unscaling(optimizer: torch.optim.Optimizer) -> bool:
    return _optimizer_handles_unscaling(optimizer)


# _AcceleratorConnector._choose_auto_accelerator, ._choose_gpu_accelerator_backend: the device Lightning picks for accelerator=auto or gpu, which autocast needs before the Trainer exists. Fails: tests/test_settings.py::test_the_device_comes_from_the_accelerator_so_mps_stays_mps
def accelerator_device(accelerator: str | None) -> str:
    """The device type Lightning trains on for `accelerator`: cpu, mps or cuda."""
    if accelerator in (None, "auto"):
        accelerator = _AcceleratorConnector._choose_auto_accelerator()
    if accelerator == "gpu":
        accelerator = _AcceleratorConnector._choose_gpu_accelerator_backend()
    return accelerator if accelerator in ("cpu", "mps") else "cuda"


# _current_fx_name: the LightningModule attribute Lightning sets twice at each hook call (36 times a step), which LeanModule stores without nn.Module's checks. Fails: tests/test_overhead.py::test_lightning_still_names_the_running_hook_where_the_fast_path_stores_it
HOOK_NAME = "_current_fx_name"


# LearningRateMonitor._extract_stats: the one method that both logs the rates and puts them into callback_metrics on the training device; overridden so that they stay on the host. Fails: tests/test_overhead.py::test_the_learning_rates_in_callback_metrics_stay_on_the_host
class RatesOnHost:
    """A mixin for Lightning's LearningRateMonitor (first base): the rates it adds to
    `callback_metrics` stay on the host."""

    def _extract_stats(self, trainer, interval: str) -> dict[str, float]:
        return super()._extract_stats(_OnHost(trainer), interval)


# LearningRateMonitor._extract_stats: what a monitor logs at a step, read by the test of RatesOnHost. Fails: tests/test_overhead.py::test_the_learning_rates_in_callback_metrics_stay_on_the_host
def learning_rate_stats(monitor, trainer, interval: str) -> dict[str, float]:
    return monitor._extract_stats(trainer, interval)


class _OnHost:
    """`trainer`, whose strategy's root device reads as the CPU."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.strategy = _CPU

    def __getattr__(self, name: str):
        return getattr(self.trainer, name)


class _CPU:
    root_device = torch.device("cpu")


# nn.modules.batchnorm._BatchNorm: the one base of every BatchNorm (1d/2d/3d, SyncBatchNorm, lazy); none is public. Fails: tests/test_checkpointing.py::test_batchnorm_base_covers_every_batchnorm_and_nothing_else
BATCH_NORM = nn.modules.batchnorm._BatchNorm


# OneCycleLR._schedule_phases, ._anneal_func (torch): the one-cycle schedule's phase table and annealing, which schedules.OneCycleLR re-uses with its phases' ends on whole steps. Fails: tests/test_schedules.py::test_same_rates_as_torch_where_its_phases_are_whole_steps
def one_cycle_phases(scheduler) -> list[dict]:
    return scheduler._schedule_phases


# OneCycleLR._anneal_func (torch): see one_cycle_phases. Fails: tests/test_schedules.py::test_same_rates_as_torch_where_its_phases_are_whole_steps
def one_cycle_anneal(scheduler, start: float, end: float, pct: float) -> float:
    return scheduler._anneal_func(start, end, pct)


# torch._inductor.cudagraph_utils.cudagraphs_log: inductor's logger of its CUDA-graph decisions, whose skips compiling.py says in one line each; no public hook tells them. Fails: tests/test_compile.py::test_each_reason_torch_gives_for_no_cuda_graph_is_said_once_in_one_line
def cudagraphs_log():
    from torch._inductor.cudagraph_utils import cudagraphs_log  # imports inductor: only here

    return cudagraphs_log


# torch.ops.mkldnn._is_mkldnn_bf16_supported, _is_mkldnn_fp16_supported: oneDNN's own test for native bfloat16 / float16 kernels on this CPU (AVX512-BF16 or AMX; AVX512-FP16), which also honours ONEDNN_MAX_CPU_ISA; torch has no public one. Fails: tests/test_native.py::test_the_cpu_answer_is_onednns_own
def onednn_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs `dtype` (bfloat16 or float16) natively on this CPU."""
    test = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }[dtype]
    return bool(getattr(torch.ops.mkldnn, test)())


# torch.cpu._is_amx_fp16_supported: whether the CPU has AMX-FP16, the tiles of oneDNN's float16 training kernels; with AVX512-FP16 alone torch's float16 convolution backward ran 45x slower than float32 (Sapphire Rapids, SpeedNet 8,8,8, batch 16). Fails: tests/test_native.py::test_the_cpu_answer_is_onednns_own
def amx_fp16() -> bool:
    return bool(torch.cpu._is_amx_fp16_supported())
