"""The private names of Lightning and torch that the tests alone read, to watch what the code
does (the form of src/cifar_amp/compat.py): a release that changes one fails the test named."""

from __future__ import annotations


# torch.utils._python_dispatch.TorchDispatchMode: the one hook that sees every aten op a step runs, by which the host-sync tests catch a read of device memory. Fails: tests/test_host_sync.py::test_the_watch_sees_a_read
def dispatch_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


# OpOverload._schema: the aten name of an op the dispatch mode sees (aten::_local_scalar_dense for .item()). Fails: tests/test_host_sync.py::test_the_watch_sees_a_read
def op_name(func) -> str:
    return func._schema.name


# aten::_local_scalar_dense: the op of .item(), float(t), bool(t): a read of device memory by the host. Fails: tests/test_host_sync.py::test_the_watch_sees_a_read
HOST_READ = "aten::_local_scalar_dense"

# GradScaler._maybe_opt_step: where a GradScaler reads found_inf on the host, for an optimizer that does not take the flag itself (16-mixed with a non-fused optimizer). Fails: tests/test_host_sync.py::test_16_mixed_with_a_plain_optimizer_reads_only_the_scaler
SCALER_READ = ("torch/amp/grad_scaler.py", "_maybe_opt_step")

# LearningRateMonitor._extract_stats (overridden in src/cifar_amp/compat.py): where the core's monitor makes the rates it puts in callback_metrics, on the host. Fails: tests/test_host_sync.py::test_training_steps_read_nothing_on_the_host
RATES_ON_HOST = ("cifar_amp/compat.py", "_extract_stats")


# Trainer._logger_connector.should_update_logs: Lightning's own test of whether this step logs, which the host-sync watch counts. Fails: tests/test_host_sync.py::test_training_steps_read_nothing_on_the_host
def logs_this_step(trainer) -> bool:
    return trainer._logger_connector.should_update_logs


# Trainer._accelerator_connector: what Lightning chose from the Trainer's arguments (its precision plugin, its cluster environment). Fails: tests/test_train.py::test_the_trainer_is_built_with_the_16_mixed_plugin_and_keeps_it
def accelerator_connector(trainer):
    return trainer._accelerator_connector


# lightning.pytorch.callbacks.progress.rich_progress._RICH_AVAILABLE: Lightning's record of whether rich is installed, turned off to stand for a machine without it. Fails: tests/test_bad_input.py::test_a_callback_whose_package_is_missing_is_one_line_naming_it
def without_rich(monkeypatch) -> None:
    from lightning.pytorch.callbacks.progress import rich_progress

    monkeypatch.setattr(rich_progress, "_RICH_AVAILABLE", False)


# OptimizedModule._orig_mod: the attribute torch.compile's wrapper keeps the network under, which a checkpoint's keys must not hold. Fails: tests/test_train.py::test_compiled_network_trains_and_saves_plain_keys
COMPILED_WRAPPER = "_orig_mod"


# torch._dynamo.utils.counters: torch's counts of compiled frames and of CUDA-graph skips. Fails: tests/test_compile.py::test_reduce_overhead_trains_the_speed_recipe_on_cpu_says_why_no_graphs_and_resumes
def dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    return counters


# torch._inductor.cudagraph_utils.cudagraphs_log, log_cudagraph_skip_and_bump_counter: inductor's own logger and the function it tells a CUDA-graph skip by. Fails: tests/test_compile.py::test_each_reason_torch_gives_for_no_cuda_graph_is_said_once_in_one_line
def skip_cuda_graph(message: str) -> None:
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    log_cudagraph_skip_and_bump_counter(message)


# torch._inductor.cudagraph_trees.get_manager: the CUDA-graph trees' manager of a device, which exists once a graph was captured there. Fails: tests/test_compile.py::test_cuda_graphs_capture_the_default_recipe_with_no_fallback
def cuda_graphs_recorded(device: int = 0) -> bool:
    from torch._inductor import cudagraph_trees

    return cudagraph_trees.get_manager(device, create_if_none_exists=False) is not None


# hydra._internal.config_loader_impl.ConfigLoaderImpl._apply_overrides_to_config: how Hydra applies a command line's key overrides (`a.b=1`, `+a.c=2`, `++a.d=3`, `~a.e`) to the composed config, which the tests' compose_cfg applies to a config composed once. Fails: tests/test_config.py::test_compose_cfg_is_what_hydra_composes
def apply_key_overrides(cfg, overrides: list) -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)
