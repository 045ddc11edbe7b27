"""The one exception type that means "the user asked for something we cannot do".

Entry points print its message on one line and exit non-zero, without a traceback
(set HYDRA_FULL_ERROR=1 to see one)."""

from __future__ import annotations

import contextlib
import difflib
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


def check_overrides(argv: list[str], config_dir: Path, config_name: str) -> None:
    """Exit 2 with one line for an override that cannot compose, before Hydra runs.

    Hydra refuses these too, over several lines and without saying what would be valid:
    an unknown group option, a key that does not exist (with the close matches and the valid
    keys), a value of the wrong type. Runs with flags (-m, --cfg, ...) are left to Hydra.
    """
    _check_group_choices(argv, config_dir)
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    from cifar_amp import config  # noqa: F401  (registers the schemas the configs start from)

    def composed(overrides):
        with initialize_config_dir(str(config_dir.resolve()), version_base="1.3"):
            return compose(config_name, overrides=overrides)

    try:
        composed(argv)
        return
    except ConfigCompositionException as e:
        cause = e.__cause__
    except Exception:  # anything else (syntax, ...): Hydra reports it in its own words
        return
    key = getattr(cause, "full_key", None)
    if not key:
        return
    bad = next((a for a in argv if a.lstrip("+~").startswith(key)), "")
    if isinstance(cause, ValidationError):
        _fail(f"{bad or key}: {str(cause.msg).splitlines()[0]}")
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        parent, _, name = key.rpartition(".")
        try:
            cfg = composed([a for a in argv if a != bad])
            node = OmegaConf.select(cfg, parent) if parent else cfg
            valid = sorted(str(k) for k in node.keys())
        except Exception:
            valid = []
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f"did you mean {(parent + '.') if parent else ''}{close[0]}? " if close else ""
        where = parent or "the config"
        _fail(f"{key} is not a config key; {hint}valid keys of {where}: {', '.join(valid)}")


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(EXIT_CODE)


def _check_group_choices(argv: list[str], config_dir: Path) -> None:
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
