"""`module.compile`: torch.compile of the network in place, its artefacts cached across runs,
and each fallback from CUDA graphs said in one line."""

import logging
import os
import weakref
from pathlib import Path

log = logging.getLogger(__name__)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPHS = ("reduce-overhead", "max-autotune")  # the modes that capture CUDA graphs
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_compiled = weakref.WeakSet()  # Lightning calls configure_model at fit, then again at test


def use_cache_dir() -> None:
    """Inductor's caches (FX graphs, AOTAutograd, Triton kernels) in the user's cache directory,
    which outlives torch's default /tmp/torchinductor_<user> (emptied at reboot, private to a
    job on many clusters), unless TORCHINDUCTOR_CACHE_DIR names one. Called when the package is
    imported: torch._dynamo's import fixes the directory (torch only, so no torch import here)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ.setdefault(CACHE_ENV, str(base / "cifar_amp" / "torchinductor"))


def compile_net(net, mode: str, device) -> None:
    """`net.compile(mode=mode)`: in place, so state-dict keys are the same compiled or not."""
    if net in _compiled:
        return
    _compiled.add(net)
    if mode in CUDA_GRAPHS:
        if device.type != "cuda":  # torch counts these skips but, off a GPU, says nothing
            log.warning(f"Compile: {mode} captures CUDA graphs, which need CUDA; none on {device}")
        _say_cuda_graph_skips()
    log.info(f"Compile: the network, mode {mode}, cached in {os.environ.get(CACHE_ENV)}")
    net.compile(mode=mode)


class _CudaGraphSkips(logging.Filter):
    """On torch's CUDA-graph log: each reason torch gives for running a graph without CUDA graphs
    (a mutated input, a dynamic shape, ...), said once in one line; torch's own message, with
    its stack trace, only where TORCH_LOGS=cudagraphs asks for it."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith(("skipping cudagraph", "disabling cudagraph")):
            return True
        reason = text.splitlines()[0].partition(". Found from")[0].partition("due to ")[2]
        if reason not in self.said:
            self.said.add(reason)
            log.warning(
                f"Compile: a graph runs without CUDA graphs: {reason} (where: TORCH_LOGS=cudagraphs)"
            )
        # TORCH_LOGS=cudagraphs sets its logger to DEBUG
        return logging.getLogger(record.name).level == logging.DEBUG


def _say_cuda_graph_skips() -> None:
    from cifar_amp import compat  # imports torch, which this module must not at its import

    cudagraphs_log = compat.cudagraphs_log()
    if not any(isinstance(f, _CudaGraphSkips) for f in cudagraphs_log.filters):
        cudagraphs_log.addFilter(_CudaGraphSkips())
