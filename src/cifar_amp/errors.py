"""What "the user asked for something we cannot do" looks like: a UserError, printed by the
entry points on one line with exit code 2 and no traceback (HYDRA_FULL_ERROR=1 shows one). A
package of an extra that is not installed is such a case too: one line with its pip command."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import os
import re
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


@functools.cache
def declared() -> dict[str, str]:
    """The packages this project's pyproject.toml declares, by normalised name -> how to install
    it (`pip install -e '.[<extra>]'` for an extra's); empty where the project is not installed."""
    try:
        lines = importlib.metadata.requires("cifar-amp") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    out = {}
    for line in lines:
        name = re.match(r"[\w.-]+", line)[0].lower().replace("_", "-")
        extra = re.search(r'extra == "([^"]+)"', line)
        spec = line.split(";")[0].strip()
        how = f"pip install -e '.[{extra[1]}]'" if extra else f"pip install '{spec}'"
        out.setdefault(name, how)
    return out


def missing_package(e: BaseException) -> str | None:
    """`<package>, which is not installed here: <how to install it>` where `e` is an
    ImportError about a package this project declares (by module name, or named in the message
    as Lightning's requirement checks do); None for any other error."""
    if not isinstance(e, ImportError):
        return None
    names = e.name.split(".") if e.name else re.findall(r"[`']([A-Za-z][\w-]*)", str(e))
    for name in names:
        key = name.lower().replace("_", "-")
        if key in declared() and key != "cifar-amp":
            return f"{key}, which is not installed here: {declared()[key]}"
    return None


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(EXIT_CODE)


@contextlib.contextmanager
def reported():
    """A UserError (or Lightning's MisconfigurationException), or an ImportError of a package
    this project declares (missing_package) -> one line on stderr, exit 2."""
    try:
        yield
    except (*REPORTED, ImportError) as e:
        if isinstance(e, REPORTED):
            msg = one_line(e)
        elif missing := missing_package(e):
            msg = f"this command needs {missing}"
        else:
            raise
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if logging.getLogger().handlers:  # a run's log (train.log) keeps it too
            log.error("%s", msg)
        fail(msg)
