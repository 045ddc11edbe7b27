"""Checkpoints of this template's earlier releases, read as today's. A fork may delete this module
(and tests/test_checkpoints.py's RELEASES, tests/assets/, the tests that name them)."""


def tracker_runs(runs: dict, logger_cfg) -> dict:
    """Logger config key -> run id, from earlier releases' {logger class: {attribute: run id}}."""
    out = {}
    for key, node in (logger_cfg or {}).items():
        if run := runs.get(str((node or {}).get("_target_")).rsplit(".", 1)[-1]):
            out[key] = next(iter(run.values()))
    return out
