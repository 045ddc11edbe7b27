"""No host-device synchronisation inside a training step.

A host read of a device tensor (`.item()`, `bool(t)`, `.tolist()`, a boolean-mask index, ...)
makes the host wait until the GPU has run everything queued: the GPU then idles while Python
prepares the next step. The training step is meant to be free of them by design; these tests
run real Lightning training steps of the composed config after warm-up and fail on any read
that is not on the allow-list below, which names each remaining one and why.

- CPU (default run): Python-level reads (TorchFunctionMode) and the aten ops that read device
  data on the host under CUDA (TorchDispatchMode: `_local_scalar_dense`, `nonzero`, boolean
  indexing, ...). It cannot see a sync made inside a CUDA kernel launcher that has no CPU
  counterpart, nor a blocking host-to-device copy.
- GPU (`-m gpu`): `torch.cuda.set_sync_debug_mode`, which sees every synchronising CUDA call
  made by torch, C++ included; each one is reported with the Python line that caused it.
"""

from __future__ import annotations

import threading
import traceback
import warnings

import lightning as L
import pytest
import torch
from torch.overrides import TorchFunctionMode

import compat
from cifar_amp import build
from cifar_amp.training import train
from conftest import requires_cuda

WARMUP, STEPS = 3, 5  # steps before the window (compilation, autotuning), steps in it
# What torch.cuda.set_sync_debug_mode("warn") says of each synchronising call (c10/cuda). Matched
# exactly: the first set_sync_debug_mode of a process also warns, once, that the mode "does not
# yet detect all synchronizing operations", which is no sync (it failed the first GPU case).
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"

# (file suffix, function) of a frame on the reading call's stack -> why the read stays.
ALLOWED = {
    compat.RATES_ON_HOST: (
        "the learning rates that Lightning's monitor puts in callback_metrics, made on the host "
        "by the core's monitor (Lightning's copies them onto the device)"
    ),
    compat.SCALER_READ: (
        "16-mixed with a non-fused optimizer: GradScaler reads found_inf to skip the step; "
        "module.optimizer.fused=true moves the skip into the optimizer kernel (no read), "
        "clipping or not"
    ),
}

# aten ops that read device data on the host under CUDA (or size their output by it).
SYNCING_OPS = {
    compat.HOST_READ,  # .item(), bool(t), float(t), int(t)
    "aten::nonzero",
    "aten::masked_select",
    "aten::bincount",
    "aten::equal",
    "aten::unique_dim",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::repeat_interleave",
}


def _where() -> list[traceback.FrameSummary]:
    mine = ("_where", "__torch_function__", "__torch_dispatch__", "_on_warning")
    return [f for f in traceback.extract_stack() if f.name not in mine]


def _allowed(stack: list[traceback.FrameSummary], allowed: dict) -> bool:
    return any(f.filename.endswith(s) and f.name == fn for f in stack for s, fn in allowed)


def _describe(what: str, stack: list[traceback.FrameSummary]) -> str:
    plumbing = ("/pytest", "pluggy", "/torch/_", "torch/utils/_", "torch/overrides.py")
    frames = [f for f in stack if not any(p in f.filename for p in plumbing)]
    return what + "\n" + "".join(traceback.format_list(frames[-8:]))


class _PythonReads(TorchFunctionMode):
    """Reads that do not reach the dispatcher on CPU (`tolist`, `numpy`, `cpu`), and tensors
    made from host data in a step (`torch.tensor`, `as_tensor`, `from_numpy`): on CUDA those
    are placed on the device by a blocking copy."""

    def __init__(self, found: list) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        read = name in ("tolist", "numpy", "cpu", "tensor", "as_tensor", "from_numpy")
        if read:
            self.found.append((f"Tensor.{name}" if name != "tensor" else "torch.tensor", _where()))
        return func(*args, **kwargs)


class _AtenReads(compat.dispatch_mode()):
    def __init__(self, found: list) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = compat.op_name(func)
        bool_index = name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        )
        if name in SYNCING_OPS or bool_index:
            self.found.append((str(func) + (" (boolean mask)" if bool_index else ""), _where()))
        return func(*args, **kwargs)


class SyncWatch(L.Callback):
    """Watches the training steps `warmup` .. `warmup + steps - 1` of epoch `epoch`: from this
    callback's on_train_batch_start of the first one to its on_train_batch_start after the last,
    so the window holds whole steps (loader, hooks, forward, backward, optimizer, schedule), and
    counts the steps in it that log or redraw the progress bar."""

    def __init__(self, warmup=WARMUP, steps=STEPS, cuda: bool = False, epoch: int = 0) -> None:
        self.warmup, self.steps, self.cuda, self.epoch = warmup, steps, cuda, epoch
        self.found: list = []
        self.watched = self.logged = self.redrawn = 0
        self._modes: list = []
        self._warnings = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.current_epoch != self.epoch:
            return
        if batch_idx == self.warmup:
            self._start()
        elif batch_idx == self.warmup + self.steps:
            self.watched = self.steps
            self._stop()
        if self.warmup <= batch_idx < self.warmup + self.steps:
            self.logged += compat.logs_this_step(trainer)  # Lightning's own test
            bar = trainer.progress_bar_callback
            self.redrawn += bool(bar and (batch_idx + 1) % bar.refresh_rate == 0)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop()

    def _start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._on_warning  # restored by catch_warnings
            torch.cuda.set_sync_debug_mode("warn")  # its once-per-process notice: not a sync
        else:
            self._modes = [_PythonReads(self.found), _AtenReads(self.found)]
            for m in self._modes:
                m.__enter__()

    def _on_warning(self, message, *args, **kwargs) -> None:
        # torch turns the C++ warning into a Python one on return from the call, so the stack
        # here is that of the Python line that made it.
        # The training thread's only: the checkpoint writer's copies to the host wait on its
        # own thread (the reliability extra), as the CPU modes above see only this thread.
        if threading.current_thread() is not threading.main_thread():
            return
        if str(message).startswith(CUDA_SYNC_WARNING):
            self.found.append((str(message).splitlines()[0], _where()))

    def _stop(self) -> None:
        for m in reversed(self._modes):
            m.__exit__(None, None, None)
        self._modes = []
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(None, None, None)
            self._warnings = None


def unexplained(found: list, allowed: dict | None = None) -> list[str]:
    """The reads of `found` that neither ALLOWED nor `allowed` (an extra's) explains."""
    allowed = ALLOWED | (allowed or {})
    return [_describe(what, stack) for what, stack in found if not _allowed(stack, allowed)]


def _watch(make_cfg, monkeypatch, *overrides, cuda: bool = False, epoch: int = 0) -> SyncWatch:
    cfg = make_cfg("test=false", *overrides)  # (step checkpoints: every 500 steps)
    watch = SyncWatch(cuda=cuda, epoch=epoch)
    built = build.callbacks
    monkeypatch.setattr(build, "callbacks", lambda c: [*built(c), watch])
    train(cfg)
    assert watch.watched == STEPS, "the run was too short to watch its steps"
    return watch


# As a user runs it: the CSV logger and a progress bar, watched in the second epoch (the first
# one's metrics are then on the progress bar), over a step that logs and one that redraws.
AS_USED = (
    "trainer.max_epochs=2",
    "logger=csv",
    "trainer.log_every_n_steps=5",
    "trainer.enable_progress_bar=true",
    "callbacks.progress_bar.refresh_rate=5",
)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_training_steps_read_nothing_on_the_host(make_cfg, monkeypatch, precision):
    # (the default recipe: a fused optimizer, clipping)
    watch = _watch(make_cfg, monkeypatch, *AS_USED, f"precision={precision}", epoch=1)
    assert watch.logged == 1 and watch.redrawn == 1
    bad = unexplained(watch.found)
    assert not bad, "host reads in training steps:\n" + "\n".join(bad)


def test_the_watch_sees_a_read(make_cfg, monkeypatch):
    """The test above can fail: a callback that reads the loss each step is caught."""
    cfg = (
        "+callbacks.reader._target_=test_host_sync.ReadLoss",
        "trainer.max_epochs=1",
    )
    watch = _watch(make_cfg, monkeypatch, *cfg)
    bad = unexplained(watch.found)
    assert len(bad) == STEPS and all(
        "float(outputs" in b and compat.HOST_READ.partition("::")[2] in b for b in bad
    )


def test_16_mixed_with_a_plain_optimizer_reads_only_the_scaler(make_cfg, monkeypatch):
    overrides = ("trainer.max_epochs=1", "precision=16-mixed", "module.optimizer.fused=false")
    watch = _watch(make_cfg, monkeypatch, *overrides)
    assert len(watch.found) == STEPS and not unexplained(watch.found)


class ReadLoss(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        float(outputs["loss"])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "overrides",
    [
        ("precision=32-true",),
        ("precision=bf16-mixed",),
        ("precision=16-mixed",),  # fused and clipped, as the default recipe runs it
        ("module.compile=true", "precision=bf16-mixed"),
    ],
    ids=["32-true", "bf16-mixed", "16-mixed", "compiled"],
)
def test_training_steps_make_no_cuda_sync(make_cfg, monkeypatch, overrides):
    watch = _watch(make_cfg, monkeypatch, "trainer=gpu", *AS_USED, *overrides, cuda=True, epoch=1)
    assert watch.logged == 1 and watch.redrawn == 1
    bad = unexplained(watch.found)
    assert not bad, "CUDA syncs in training steps:\n" + "\n".join(bad)


def test_the_cuda_watch_counts_syncs_not_the_modes_own_notice():
    """The first `set_sync_debug_mode` of a process warns once that the mode is a prototype;
    only the warnings of synchronising calls count."""
    watch = SyncWatch(cuda=True)
    notice = (
        "Synchronization debug mode is a prototype feature and does not yet detect all "
        "synchronizing operations (Triggered internally at torch/csrc/cuda/Module.cpp)"
    )
    sync = f"{CUDA_SYNC_WARNING} (Triggered internally at c10/cuda/CUDAFunctions.cpp)"
    for message in (notice, sync):
        watch._on_warning(UserWarning(message), UserWarning, "step.py", 1)
    assert [what for what, _ in watch.found] == [sync]
