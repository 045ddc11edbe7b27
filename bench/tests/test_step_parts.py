"""bench/step_parts.py: each case takes away what it says, and its dry run times every case."""

import pytest

from bench import gpu as G
from bench import step_parts as S


def test_each_case_takes_away_what_it_names():
    base = G.compose([])
    for label, overrides in S.CASES:
        cfg = G.compose(overrides)  # `~callbacks.<name>` of a name the config lacks fails here
        gone = set(base.callbacks) - set(cfg.callbacks)
        assert gone == (
            set(S.CALLBACKS)
            if "no callbacks" in label
            else {"precision_diagnostics"}
            if label == "no diagnostics"
            else set()
        ), label
        clipped = cfg.trainer.gradient_clip_val is not None
        assert clipped is not ("no clipping" in label), label
        assert bool(cfg.module.optimizer.fused) is ("fused" in label), label


@pytest.mark.slow  # 7 cases, each a Lightning fit and a plain loop: about 10 s on the 2-core box
def test_dry_run_times_every_case(tmp_path):
    out = tmp_path / "parts.json"
    result = S.main(["--modes", "16-mixed", "--out", str(out)])
    assert [r["case"] for r in result["cases"]] == [label for label, _ in S.CASES]
    assert all(r["template"]["step_ms"] > 0 and r["plain"]["step_ms"] > 0 for r in result["cases"])
    assert out.read_text().count('"case"') == len(S.CASES)
