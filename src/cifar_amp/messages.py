"""Lightning's messages that tell a user of this template nothing to act on, silenced where they
arise: each by its own text and the module that says it, never a whole category. Every entry
says why; tests/test_messages.py fails when a default run prints any other warning."""

import logging
import warnings

# (message start, module that warns, why it says nothing to act on)
WARNINGS = (
    (
        "Experiment logs directory ",
        "lightning.fabric.loggers.csv_logs",
        "the run dir holds config.yaml before the CSV logger starts: it is never empty, and the "
        "run dir's claim (runs.claim) has kept an earlier metrics.csv as metrics.<n>.csv",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "lightning.pytorch.utilities._pytree",
        "Lightning 2.6's own use of a name torch 2.14 deprecates",
    ),
    (
        r"The number of training batches \(\d+\) is smaller than the logging interval",
        "lightning.pytorch.loops.fit_loop",
        "epochs are logged whatever the interval; the learning-rate monitor says when no step "
        "of the run will be logged (overhead.LearningRateMonitor)",
    ),
)
# (start of a log line of Lightning's, why it says nothing to act on)
LOG_LINES = (
    ("💡 Tip: For seamless cloud", "an advertisement for a product, in every run"),
    (
        "Trainer already configured with model summary callbacks",
        "the template's own layer table (summary.py) stands in for Lightning's, as configured",
    ),
)


class _Unhelpful(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(tuple(start for start, _ in LOG_LINES))


def quiet() -> None:
    """Silence the messages above (idempotent; a Trainer's building calls it)."""
    for message, module, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _Unhelpful) for f in rank_zero.filters):
        rank_zero.addFilter(_Unhelpful())
