"""The private Lightning, torch and torchvision names the benchmarks use (the form of
src/cifar_amp/compat.py)."""

from __future__ import annotations

from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torchvision.datasets import CIFAR10

# _TrainingEpochLoop: Lightning's training loop, whose advance and on_advance_end bound one step for bench.call_count. Fails: bench/tests/test_call_count.py::test_both_loops_are_counted_step_by_step
TrainingEpochLoop = _TrainingEpochLoop

# _EvaluationLoop: Lightning's validation loop, whose run bench.call_count pauses the count for. Fails: bench/tests/test_call_count.py::test_both_loops_are_counted_step_by_step
EvaluationLoop = _EvaluationLoop


# torch._subclasses.fake_tensor.FakeTensorMode, torch.distributed._tools.mem_tracker.MemTracker: no public API traces a step's memory by kind without allocating it (bench.memory). Fails: bench/tests/test_precision_modes.py::test_memory_breakdown_alone_needs_no_training
def memory_tools() -> tuple[type, type]:
    """(FakeTensorMode, MemTracker), imported when asked: they import torch's internals."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    return FakeTensorMode, MemTracker


# CIFAR10._check_integrity, ._load_meta (torchvision): the md5 check against the official archive, which refuses the subset's folder, and the class names, which a folder may lack; bench.loader_speed times torchvision's per-sample work otherwise unchanged. Fails: bench/tests/test_speed.py::test_loader_benchmark_runs_tiny
class UncheckedCIFAR10(CIFAR10):
    def _check_integrity(self) -> bool:
        return True

    def _load_meta(self) -> None:
        self.classes = [str(i) for i in range(10)]
