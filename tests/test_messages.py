"""A first run prints nothing to ignore: no warning the template did not mean, no advertisement,
a layer table of the network alone with its FLOPs, and the logging-interval hint only where it
is true for the run (src/cifar_amp/messages.py)."""

from __future__ import annotations

import logging
import warnings

from cifar_amp import messages
from cifar_amp.training import train

FIRST_RUN = ("logger=csv", "trainer.enable_model_summary=true")  # as `python train.py` runs


def run(make_cfg, caplog, *overrides: str) -> tuple[list[str], list[logging.LogRecord]]:
    """(the warnings raised, the log records) of a tiny run."""
    with warnings.catch_warnings(record=True) as raised, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        train(make_cfg(*FIRST_RUN, *overrides))
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in raised], caplog.records


def test_a_first_run_has_no_warning_and_no_advertisement(make_cfg, caplog):
    raised, records = run(make_cfg, caplog)
    assert raised == []
    said = [r.getMessage() for r in records]
    assert not [m for m in said if m.startswith(tuple(s for s, _ in messages.LOG_LINES))]
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert warned == [  # 11 steps in the tiny folder's epoch: the hint is true, and says so
        "Logging: the run's 11 optimizer steps are fewer than trainer.log_every_n_steps=50, so "
        "no step's values (the learning rate, ...) are logged, only epochs': "
        "trainer.log_every_n_steps=11 logs the last"
    ]
    table = next(m for m in said if "Total Flops" in m)
    rows = table.split("-\n")[1].splitlines()[:-1]
    assert len(rows) == 1 and " net " in rows[0]  # no metric object
    assert "0         Total Flops" not in table and "[1, 3, 32, 32]" in rows[0]


def test_the_logging_hint_is_not_said_where_steps_are_logged(make_cfg, caplog):
    _, records = run(make_cfg, caplog, "trainer.log_every_n_steps=5")
    assert not [r for r in records if r.getMessage().startswith("Logging: ")]


def test_each_silenced_message_says_why_and_names_its_module():
    for message, module, why in messages.WARNINGS:
        assert module.startswith("lightning.") and message and len(why) > 20
    assert all(len(why) > 20 for _, why in messages.LOG_LINES)
