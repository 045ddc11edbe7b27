"""bench/call_count.py: the counter counts what it says, and a count of both loops runs."""

import threading

import pytest

from bench import call_count as C


def test_the_counter_counts_python_and_builtin_calls_in_every_thread():
    def f():
        return len([1])  # a Python call and a built-in one

    counter = C.Counter()
    with counter.installed():
        counter.start()
        f()
        t = threading.Thread(target=f)  # started after the counter: profiled too
        t.start()
        t.join()
        counter.stop()
        counter.start()
        counter.stop()
    assert counter.steps[1] == 1  # the call of stop() itself
    # f and len here, f and len in the thread, the thread machinery's own calls, stop()
    assert counter.steps[0] > 5


@pytest.mark.slow  # two profiled fits of 120 steps: about a minute on the 2-core box
def test_both_loops_are_counted_step_by_step(tmp_path):
    result = C.main(["--modes", "bf16-mixed", "--out", str(tmp_path / "c.json"), "--"])
    row = result["bf16-mixed"]
    assert row["steps"] == 120  # every training step of the epoch
    assert row["template"] > row["plain"] > 100
    assert (tmp_path / "c.json").read_text().count('"template"') == 1
