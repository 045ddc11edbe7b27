"""The one exception type that means "the user asked for something we cannot do".

Entry points print its message on one line and exit non-zero, without a traceback
(set HYDRA_FULL_ERROR=1 to see one)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

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


def check_group_choices(argv: list[str], config_dir: Path) -> None:
    """Exit 2 with one line if an override picks a config group option that does not exist.

    Hydra would also refuse it, but over several lines; this names the key and the valid
    choices on one. Sweeps (`precision=32-true,16-mixed`) are checked item by item.
    """
    for arg in argv:
        key, sep, value = arg.partition("=")
        group = config_dir / key.lstrip("+")
        if (
            not sep
            or "." in key
            or "/" in key
            or key.startswith("~")
            or not group.is_dir()
            or "(" in value
        ):
            continue
        valid = sorted(p.stem for p in group.glob("*.yaml"))
        for choice in value.split(","):
            if choice not in valid and choice != "null":
                print(
                    f"error: {key}={choice} is not an option; valid: {', '.join(valid)}",
                    file=sys.stderr,
                )
                sys.exit(EXIT_CODE)
