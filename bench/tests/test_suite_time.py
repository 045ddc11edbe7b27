"""bench/suite_time.py: each run of each command timed in turn, its exit status kept."""

import json
import sys

from bench import suite_time


def test_two_commands_are_timed_in_turn_and_a_failure_is_said(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["--runs", "2", "--vs", "exit 3", "--out", str(out), "--", sys.executable, "-c", "pass"]
    result = suite_time.main(argv)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert [line.split(":")[0] for line in printed] == ["run 1 A", "run 1 B", "run 2 A", "run 2 B"]
    assert [r["exit"] for r in result["runs"]["A"]] == [0, 0]
    assert [r["exit"] for r in result["runs"]["B"]] == [3, 3]
    seconds = result["seconds"]["A"]
    assert 0 < seconds["min"] <= seconds["median"] <= seconds["max"]
    assert json.loads(out.read_text())["median_ratio_a_to_b"] == result["median_ratio_a_to_b"]
