"""The one exception type that means "the user asked for something we cannot do".

Entry points print its message on one line and exit non-zero, without a traceback
(set HYDRA_FULL_ERROR=1 to see one)."""

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
    """Raised by a constructor for an out-of-range argument; the builder that called it
    names the config key (``invalid config value for data.batch_size: 0; must be >= 1``)."""

    def __init__(self, arg: str, value, rule: str) -> None:
        super().__init__(f"{arg}: {value}; {rule}")
        self.arg = arg


class NestedBuildError(Exception):
    """Raised by a constructor that builds a part of its own from config (the module builds
    the model), so that the error is reported by that part's key, not the constructor's."""

    def __init__(self, key: str, cause: Exception) -> None:
        super().__init__(f"{key}: {cause}")
        self.key = key


@contextlib.contextmanager
def reported():
    """Turn UserError (and Lightning's MisconfigurationException) into one line and exit 2."""
    try:
        yield
    except (UserError, MisconfigurationException) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        msg = str(e).strip().replace("\n", " ")
        if logging.getLogger().handlers:  # a run's log (train.log); else it would print twice
            log.error("%s", msg)
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(EXIT_CODE)
