"""bfloat16 and float16 only where the device runs them natively: one answer (precision.native)
that the CPU recipes, precision=auto and the Optuna search share."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cifar_amp import build, compat, precision
from cifar_amp.errors import UserError
from cifar_amp.training import build_run, train
from conftest import options

# Their answers follow this CPU's bfloat16/float16 instructions: make test-avx2 runs them capped.
pytestmark = pytest.mark.native

# the core's and the speedrun extra's, where it is here
CPU_RECIPES = [f"experiment={e}" for e in ("cpu_quick", "speedrun") if e in options("experiment")]
SHRUNK = ("model.widths=[8,8,8]", "data.batch_size=16")  # the recipes' SpeedNet, narrow


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").is_file(), reason="x86 Linux"
)
def test_the_cpu_answer_is_onednns_own():
    """On x86, oneDNN's answers follow the CPU's instruction sets (/proc/cpuinfo's flags)."""
    flags = cpu_flags()
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2":  # capped: an AVX2 CPU's answer
        flags -= {"avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16"}
    assert compat.onednn_native(torch.bfloat16) == ("avx512_bf16" in flags)
    assert compat.onednn_native(torch.float16) == ("avx512_fp16" in flags)
    assert compat.amx_fp16() == ("amx_fp16" in flags)
    assert precision.native("cpu") == ("avx512_bf16" in flags, "amx_fp16" in flags)


@pytest.mark.slow
def test_a_cpu_capped_at_avx2_has_neither():
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN treat this CPU as an AVX2 one (how the docs'
    AVX2 figures were taken on a newer CPU): the answer follows it."""
    code = "import torch; from cifar_amp import precision; print(precision.native('cpu'))"
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "PATH": "/usr/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "(False, False)", out.stderr


@pytest.mark.parametrize("recipe", CPU_RECIPES)
@pytest.mark.parametrize("bf16, trained", [(True, "bf16-mixed"), (False, "32-true")])
def test_the_cpu_recipes_take_bfloat16_only_where_it_is_native(
    make_cfg, monkeypatch, caplog, recipe, bf16, trained
):
    monkeypatch.setattr(precision, "native", lambda device_type: (bf16, False))
    run = build_run(make_cfg(recipe, *SHRUNK, "trainer.max_epochs=1"))
    assert run.precision.name == trained
    with caplog.at_level(logging.INFO, logger=precision.__name__):
        run.precision.setup(run.trainer)
    line = next(r.getMessage() for r in caplog.records if r.name == precision.__name__)
    if bf16:
        assert line.startswith("Precision: bf16-mixed (native here; 32-true where emulated)")
    else:
        assert line.startswith(
            "Precision: 32-true (bf16-mixed asked: this CPU emulates bfloat16; "
            "precision.where_emulated=null trains in it all the same)"
        )


def test_a_fixed_mode_is_trained_as_asked_wherever(make_cfg, monkeypatch):
    monkeypatch.setattr(precision, "native", lambda device_type: (False, False))
    assert build.precision(make_cfg("precision=bf16-mixed")).name == "bf16-mixed"


def test_a_run_without_native_bfloat16_resumes_in_the_mode_it_trained_in(
    make_cfg, monkeypatch, tmp_path
):
    monkeypatch.setattr(precision, "native", lambda device_type: (False, False))
    short = ("trainer.max_epochs=1", "trainer.limit_train_batches=2", "test=false")
    result = train(make_cfg("experiment=cpu_quick", *SHRUNK, *short))
    assert result["precision"] == "32-true"
    last = tmp_path / "checkpoints" / "last.ckpt"
    resumed = ("trainer.max_epochs=2", f"ckpt_path={last}")
    assert train(make_cfg("experiment=cpu_quick", *SHRUNK, *short[1:], *resumed))["epochs"] == 2
    monkeypatch.setattr(precision, "native", lambda device_type: (True, False))
    with pytest.raises(UserError, match="was trained with precision=32-true; this run asks for"):
        build_run(make_cfg("experiment=cpu_quick", *SHRUNK, *resumed))  # now it would be bf16


def test_a_bad_fallback_mode_is_one_line(make_cfg):
    with pytest.raises(UserError, match="invalid config value for precision.where_emulated: 'x'"):
        build.precision(make_cfg("precision.where_emulated=x"))


def test_a_resumed_run_goes_on_in_the_mode_it_began_in_even_where_emulated(monkeypatch):
    monkeypatch.setattr(precision, "native", lambda device_type: (False, False))
    fresh = precision.Precision("bf16-mixed", where_emulated="32-true")
    resumed = precision.Precision("bf16-mixed", where_emulated="32-true")
    fresh.settle("cpu")
    resumed.settle("cpu", resumes="bf16-mixed")
    assert (fresh.name, resumed.name) == ("32-true", "bf16-mixed")
