"""A UserError, or a missing package of an extra, is one line on stderr, exit 2, no traceback."""

import contextlib
import functools
import importlib.metadata
import logging
import os
import re
import sys
from pathlib import Path

from lightning.fabric.utilities.exceptions import MisconfigurationException


class UserError(Exception):
    pass


REPORTED = (UserError, MisconfigurationException)  # Lightning's refusals are one line too
EXIT_CODE = 2


class InvalidArgument(ValueError):
    def __init__(self, arg: str, value, rule: str) -> None:
        """A constructor's bad argument; its builder names the key: `invalid config value for`."""
        super().__init__(f"{arg}: {value}; {rule}")


class NestedBuildError(Exception):
    def __init__(self, key: str, cause: Exception) -> None:
        """An error of a part a constructor builds (the module, its model), by its config key."""
        super().__init__(f"{key}: {cause}")
        self.key = key


def one_line(e: BaseException) -> str:
    return str(e).strip().replace("\n", " ")


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(EXIT_CODE)


@functools.cache
def pip_commands() -> dict[str, str]:
    """pyproject.toml's packages by normalised name -> pip command (found by a fork's name too):
    the installed distribution's requirements, or a checkout's pyproject.toml (PYTHONPATH=src)."""
    out, dists = {}, importlib.metadata.packages_distributions().get(__name__.split(".")[0])
    own, lines = (dists[0], importlib.metadata.requires(dists[0]) or []) if dists else pyproject()
    for line in lines:
        name, extra = re.match(r"[\w.-]+", line)[0], re.search(r'extra == "([^"]+)"', line)
        how = f"-e '.[{extra[1]}]'" if extra else f"'{line.split(';')[0].strip()}'"
        if name != own:  # the test extra names the distribution itself
            out.setdefault(name.lower().replace("_", "-"), f"pip install {how}")
    return out


def pyproject() -> tuple[str, list[str]]:
    """(name, requirements as the installed metadata lists them) of the checkout holding us."""
    try:  # tomllib: Python 3.11+
        import tomllib

        path = Path(__file__).resolve().parents[2] / "pyproject.toml"
        project = tomllib.loads(path.read_text())["project"]
    except (ImportError, OSError, ValueError, KeyError):  # not in a checkout, or Python 3.10
        return "", []
    groups = project.get("optional-dependencies", {}).items()
    extras = [f'{r}; extra == "{group}"' for group, reqs in groups for r in reqs]
    return project["name"], project.get("dependencies", []) + extras


def missing_package(e: BaseException) -> str | None:
    """How to install the declared package an ImportError names (as module or in words), or None."""
    if isinstance(e, ImportError):
        names = e.name.split(".") if e.name else re.findall(r"[`']([A-Za-z][\w-]*)", str(e))
        for key in (n.lower().replace("_", "-") for n in names):
            if key in pip_commands():
                return f"{key}, which is not installed here: {pip_commands()[key]}"
    return None


@contextlib.contextmanager
def reported():
    """A UserError, Lightning's refusal or a missing_package: fail(), unless HYDRA_FULL_ERROR=1."""
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
