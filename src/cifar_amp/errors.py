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


@contextlib.contextmanager
def reported():
    """Turn UserError (and Lightning's MisconfigurationException) into one line and exit 2."""
    try:
        yield
    except (UserError, MisconfigurationException) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        msg = str(e).strip().replace("\n", " ")
        log.error("%s", msg)
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(EXIT_CODE)
