"""A UserError is what the entry points print on one line with exit code 2 and no traceback
(HYDRA_FULL_ERROR=1 shows one); so is a missing package of an extra, with its pip command."""

import contextlib
import functools
import importlib.metadata
import logging
import os
import re
import sys

from lightning.fabric.utilities.exceptions import MisconfigurationException


class UserError(Exception):
    pass


REPORTED = (UserError, MisconfigurationException)  # Lightning's refusals are one line too
EXIT_CODE = 2


class InvalidArgument(ValueError):
    """A constructor's out-of-range argument: its builder names the config key (`invalid config
    value for data.batch_size: 0; must be >= 1`)."""

    def __init__(self, arg: str, value, rule: str) -> None:
        super().__init__(f"{arg}: {value}; {rule}")


class NestedBuildError(Exception):
    """An error of a part that a constructor builds (the module, its model), by its config key."""

    def __init__(self, key: str, cause: Exception) -> None:
        super().__init__(f"{key}: {cause}")
        self.key = key


def one_line(e: BaseException) -> str:
    return str(e).strip().replace("\n", " ")


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(EXIT_CODE)


@functools.cache
def declared() -> dict[str, str]:
    """pyproject.toml's packages, by normalised name -> its pip command (`pip install -e
    '.[<extra>]'` for an extra's); empty where the project is not installed."""
    try:
        lines = importlib.metadata.requires("cifar-amp") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    out = {}
    for line in lines:
        name, extra = re.match(r"[\w.-]+", line)[0], re.search(r'extra == "([^"]+)"', line)
        how = f"-e '.[{extra[1]}]'" if extra else f"'{line.split(';')[0].strip()}'"
        out.setdefault(name.lower().replace("_", "-"), f"pip install {how}")
    return out


def missing_package(e: BaseException) -> str | None:
    """`<package>, which is not installed here: <pip command>` for an ImportError of a declared
    package (by module name, or named in the message as Lightning's checks do); else None."""
    if not isinstance(e, ImportError):
        return None
    names = e.name.split(".") if e.name else re.findall(r"[`']([A-Za-z][\w-]*)", str(e))
    for key in (n.lower().replace("_", "-") for n in names):
        if key in declared() and key != "cifar-amp":
            return f"{key}, which is not installed here: {declared()[key]}"
    return None


@contextlib.contextmanager
def reported():
    """A UserError, Lightning's MisconfigurationException or a missing_package -> fail."""
    try:
        yield
    except (*REPORTED, ImportError) as e:
        missing = missing_package(e)
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or not (missing or isinstance(e, REPORTED)):
            raise
        msg = f"this command needs {missing}" if missing else one_line(e)
        if logging.getLogger().handlers:  # a run's log (train.log) keeps it too
            logging.getLogger(__name__).error("%s", msg)
        fail(msg)
