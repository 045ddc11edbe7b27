"""`module.compile`: artefacts cached in the user's cache directory, torch's reasons for running
without CUDA graphs said in one line each, and compiled runs end to end: the speed recipe (EMA,
BatchNorm, channels_last, bf16-mixed, validation, test with TTA, a resume) and DDP on CPU
(slow); CUDA graphs with the default recipe on a GPU (gpu)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from cifar_amp import compat as core_compat
from cifar_amp import compiling, metrics
from cifar_amp.training import train
from compat import cuda_graphs_recorded, dynamo_counters, skip_cuda_graph
from conftest import REPO, SHRINK, requires_cuda

WHERE = (
    "import cifar_amp, torch._dynamo\n"  # torch._dynamo's import fixes it for the process
    "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
    "print(cache_dir())"
)


@pytest.mark.slow  # a fresh interpreter imports torch._dynamo: 4-10 s of the default run
def test_compiled_artefacts_are_cached_in_the_users_cache_dir(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != compiling.CACHE_ENV}
    env |= {"XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [sys.executable, "-c", WHERE], env=env, capture_output=True, text=True, check=True
    )
    # (torch's own default, /tmp/torchinductor_<user>, is emptied at reboot)
    assert out.stdout.strip() == str(tmp_path / "cifar_amp" / "torchinductor")


def test_a_users_own_torchinductor_cache_dir_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(compiling.CACHE_ENV, str(tmp_path))
    compiling.use_cache_dir()
    assert os.environ[compiling.CACHE_ENV] == str(tmp_path)


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_each_reason_torch_gives_for_no_cuda_graph_is_said_once_in_one_line(caplog):
    # Torch's own function and logger, as inductor calls them on CUDA (a stack trace follows).
    cudagraphs_log = core_compat.cudagraphs_log()
    mutated = (
        "skipping cudagraphs due to mutated inputs (2 instances). Found from : \n"
        '   File "net.py", line 3, in forward\n    x.add_(1)'
    )
    compiling._say_cuda_graph_skips()
    compiling._say_cuda_graph_skips()  # a second compiled network: still one filter
    torchs = Kept()
    cudagraphs_log.addHandler(torchs)
    try:
        with caplog.at_level(logging.INFO, logger="cifar_amp.compiling"):
            for _ in range(3):
                skip_cuda_graph(mutated)
            skip_cuda_graph("skipping cudagraphs due to cpu device (conv)")
            cudagraphs_log.warning("CUDAGraph supports dynamic shapes by recording ...")
    finally:
        cudagraphs_log.removeHandler(torchs)
    said = [r.getMessage() for r in caplog.records if r.name == "cifar_amp.compiling"]
    assert said == [
        "Compile: a graph runs without CUDA graphs: mutated inputs (2 instances) "
        "(where: TORCH_LOGS=cudagraphs)",
        "Compile: a graph runs without CUDA graphs: cpu device (conv) (where: TORCH_LOGS=cudagraphs)",
    ]
    # Torch's multi-line messages are not printed; its other messages are.
    assert [r.getMessage() for r in torchs.records] == [
        "CUDAGraph supports dynamic shapes by recording ..."
    ]


def compiled_frames() -> int:
    return dynamo_counters()["frames"]["total"]


SPEED = (
    "experiment=speedrun",
    "model.widths=[8,8,8]",
    "data.batch_size=16",
    "data.eval_batch_size=32",  # the test set's 60 images: a partial last batch
    "trainer.max_epochs=2",
    "callbacks.ema.update_starting_at_step=0",
    "callbacks.step_checkpoint.every_n_train_steps=2",
    "trainer.deterministic=true",
    "module.compile=true",
    "module.compile_mode=reduce-overhead",
)


@pytest.mark.slow  # compiles SpeedNet on CPU: 5 min cold, 1.5 min from the cache (loaded 2-core box)
def test_reduce_overhead_trains_the_speed_recipe_on_cpu_says_why_no_graphs_and_resumes(
    make_cfg, tmp_path, caplog
):
    frames, skips = compiled_frames(), dynamo_counters()["inductor"]["cudagraph_skips"]
    with caplog.at_level(logging.INFO, logger="cifar_amp.compiling"):
        result = train(make_cfg(*SPEED, f"run_dir={tmp_path / 'a'}"))
    assert 0.0 <= result[metrics.TEST_ACC] <= 1.0 and result[metrics.EPOCHS] == 2
    said = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert said == ["Compile: reduce-overhead captures CUDA graphs, which need CUDA; none on cpu"]
    assert dynamo_counters()["inductor"]["cudagraph_skips"] > skips  # torch skipped them, as said
    # One graph for training, one for evaluation (BatchNorm in eval mode, no grad): the batch
    # sizes of validation, test, TTA's doubled batches and the partial last batches share it,
    # and test runs under no_grad as validation does (under inference_mode it compiled again).
    assert compiled_frames() - frames == 2
    # Killed at step 5, resumed from its step-4 last.ckpt: the same weights as the whole run.
    crash = ("+callbacks.crash._target_=test_resume.CrashAt", "+callbacks.crash.step=5")
    b = make_cfg(*SPEED, *crash, "test=false", f"run_dir={tmp_path / 'b'}")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(b)
    last = tmp_path / "b" / "checkpoints" / "last.ckpt"
    b.callbacks.crash, b.ckpt_path = None, str(last)
    train(b)
    a, b = (
        torch.load(tmp_path / r / "checkpoints" / "last.ckpt", weights_only=False) for r in "ab"
    )
    assert a["global_step"] == b["global_step"] == 22
    for key in ("state_dict", "current_model_state"):  # the EMA average and the trained weights
        assert a[key].keys() == b[key].keys()
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), (key, name)


@pytest.mark.slow  # two ranks compile at once on CPU
def test_a_compiled_network_trains_under_ddp_on_two_cpu_processes(tmp_path, tiny_data):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), *SHRINK, "trainer.devices=2"]
    cmd += ["trainer.strategy=ddp", "module.compile=true"]
    cmd += [f"data.data_dir={tiny_data}", f"run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((run_dir / "metrics.json").read_text())
    assert result[metrics.EPOCHS] == 1 and 0.0 <= result[metrics.TEST_ACC] <= 1.0


# -- CUDA graphs on a GPU ---------------------------------------------------------------------
ON_GPU = ("trainer=gpu", "model=speednet", "model.widths=[16,32,32]", "data.batch_size=32")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "settings",
    [
        # the default recipe's clipping, with a fused optimizer (precision.py's Float16Mixed)
        ("precision=16-mixed", "module.optimizer.fused=true"),
        ("precision=bf16-mixed", "trainer.gradient_clip_val=null", "module.optimizer.fused=true"),
    ],
    ids=["16-mixed-fused-clipped", "bf16-mixed-fused"],
)
def test_cuda_graphs_capture_the_default_recipe_with_no_fallback(make_cfg, caplog, settings):
    """BatchNorm in training, channels_last, the mode's optimizer and scaler, validation each
    epoch and the test: no graph runs without CUDA graphs, and none compiles twice."""
    if "bf16" in settings[0] and not torch.cuda.is_bf16_supported():
        pytest.skip("no bfloat16 on this GPU")
    frames, skips = compiled_frames(), dynamo_counters()["inductor"]["cudagraph_skips"]
    cfg = make_cfg(*ON_GPU, *settings, "module.compile=true", "module.compile_mode=reduce-overhead")
    cfg.trainer.max_epochs = 2
    with caplog.at_level(logging.INFO, logger="cifar_amp.compiling"):
        result = train(cfg)
    assert 0.0 <= result[metrics.TEST_ACC] <= 1.0 and result[metrics.EPOCHS] == 2
    assert not [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert dynamo_counters()["inductor"]["cudagraph_skips"] == skips and cuda_graphs_recorded()
    assert compiled_frames() - frames == 2


@pytest.mark.gpu
@requires_cuda
def test_the_speed_recipe_resumes_under_cuda_graphs(make_cfg, tmp_path, caplog):
    speed = (*SPEED, "trainer=gpu", "test=false")
    with caplog.at_level(logging.INFO, logger="cifar_amp.compiling"):
        train(make_cfg(*speed, f"run_dir={tmp_path / 'a'}"))
        last = tmp_path / "a" / "checkpoints" / "last.ckpt"
        more = (*speed, "trainer.max_epochs=3", f"run_dir={tmp_path / 'a'}", f"ckpt_path={last}")
        result = train(make_cfg(*more))
    assert result[metrics.EPOCHS] == 3
    assert not [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    weights = torch.load(last, weights_only=False)["state_dict"]
    assert all(v.isfinite().all() for k, v in weights.items() if k.startswith("net."))


@pytest.mark.gpu
@requires_cuda
def test_a_mutated_input_on_cuda_is_said_in_one_line(caplog):
    class Mutates(torch.nn.Module):
        def forward(self, x):
            x.mul_(2)  # a graph input mutated in place: torch runs it without CUDA graphs
            return x.sum()

    net = Mutates()
    compiling.compile_net(net, "reduce-overhead", torch.device("cuda"))
    with caplog.at_level(logging.INFO, logger="cifar_amp.compiling"):
        for _ in range(3):
            net(torch.ones(4, device="cuda"))
    said = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert len(said) == 1 and "mutated inputs" in said[0] and "\n" not in said[0]
