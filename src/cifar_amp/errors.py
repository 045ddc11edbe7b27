"""What "the user asked for something we cannot do" looks like: a UserError, printed by the
entry points on one line with exit code 2 and no traceback (HYDRA_FULL_ERROR=1 shows one)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from lightning.fabric.utilities.exceptions import MisconfigurationException

log = logging.getLogger(__name__)
EXIT_CODE = 2


class UserError(Exception):
    pass


class InvalidArgument(ValueError):
    """Raised by a constructor for an out-of-range argument; the builder that called it names
    the config key (`invalid config value for data.batch_size: 0; must be >= 1`)."""

    def __init__(self, arg: str, value, rule: str) -> None:
        super().__init__(f"{arg}: {value}; {rule}")


class NestedBuildError(Exception):
    """Raised by a constructor that builds a part of its own (the module builds the model), so
    that an error is reported by that part's config key."""

    def __init__(self, key: str, cause: Exception) -> None:
        super().__init__(f"{key}: {cause}")
        self.key = key


REPORTED = (UserError, MisconfigurationException)  # Lightning's refusals are one line too


def one_line(e: BaseException) -> str:
    return str(e).strip().replace("\n", " ")


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(EXIT_CODE)


@contextlib.contextmanager
def reported():
    """A UserError (or Lightning's MisconfigurationException) -> one line on stderr, exit 2."""
    try:
        yield
    except REPORTED as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if logging.getLogger().handlers:  # a run's log (train.log) keeps it too
            log.error("%s", one_line(e))
        fail(one_line(e))
