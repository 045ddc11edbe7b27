"""Checkpoints of this template's own earlier releases, read as today's. A fork has none: it may
delete this module (and tests/test_checkpoints.py's RELEASES, tests/assets/, the tests that name
them); checkpoints.py then reads today's format alone."""


def tracker_runs(runs: dict, logger_cfg) -> dict:
    """Logger config key -> run id, from `tracker_runs` as earlier releases wrote it:
    {logger class name: {its attribute: run id}}."""
    out = {}
    for key, node in (logger_cfg or {}).items():
        if run := runs.get(str((node or {}).get("_target_")).rsplit(".", 1)[-1]):
            out[key] = next(iter(run.values()))
    return out
