"""bench/step_parts.py: each case takes away what it says, and its dry run times every case."""

import pytest

from bench import gpu as G
from bench import step_parts as S
from conftest import compose_cfg


def test_each_case_takes_away_what_it_names():
    base = compose_cfg("train")  # as G.compose composes the bench's configs
    parts = set(base.callbacks) - set(S.KEPT)
    assert "precision_diagnostics" in parts  # (the bench needs the diagnostics extra)
    for label, overrides in S.cases(base.callbacks):
        cfg = compose_cfg("train", overrides)  # `~callbacks.<name>` of a name it lacks fails
        gone = set(base.callbacks) - set(cfg.callbacks)
        expected = parts if "no callbacks" in label else set()
        assert gone == ({"precision_diagnostics"} if label == "no diagnostics" else expected), label
        clipped = cfg.trainer.gradient_clip_val is not None
        assert clipped is not ("no clipping" in label), label
        assert bool(cfg.module.optimizer.fused) is ("foreach" not in label), label


def test_a_fork_without_some_extras_gets_the_cases_of_its_callbacks():
    # The callbacks of a config whose reliability and diagnostics extras were deleted.
    keys = ["curves", "model_checkpoint", "lr_monitor"]
    found = dict(S.cases(keys))
    assert "no diagnostics" not in found
    assert found["no callbacks"] == ["~callbacks.curves", "~callbacks.lr_monitor"]


@pytest.mark.slow  # 7 cases, each a Lightning fit and a plain loop
def test_dry_run_times_every_case(tmp_path):
    out = tmp_path / "parts.json"
    # bf16-mixed: a 16-bit mode that CPUs with bfloat16 instructions run natively; float16's
    # backward runs 45x slower than float32 on a CPU without AMX-FP16.
    result = S.main(["--modes", "bf16-mixed", "--out", str(out)])
    labels = [label for label, _ in S.cases(G.compose([]).callbacks)]
    assert [r["case"] for r in result["cases"]] == labels
    assert all(r["template"]["step_ms"] > 0 and r["plain"]["step_ms"] > 0 for r in result["cases"])
    assert out.read_text().count('"case"') == len(labels)
