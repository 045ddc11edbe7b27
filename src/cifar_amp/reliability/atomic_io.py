"""Checkpoint writes that a kill or a full disk cannot tear.

Why not Lightning's TorchCheckpointIO alone: it writes through an fsspec transaction, which
stages the file in the system temp dir and then `shutil.move`s it; when /tmp is another
filesystem (the usual case on clusters) that move is a copy into the final path, so a kill
mid-copy leaves a truncated last.ckpt, and nothing is fsync'ed. Here the temp file sits next
to the target, is fsync'ed, and `os.replace` swaps it in: readers see the old file or the
new one, never a part. Remote paths (s3://, ...) keep Lightning's behaviour.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from cifar_amp.errors import UserError
from cifar_amp.reliability import private

# `.<target name>.<random>.tmp`; the random part of files from earlier versions (mkstemp) too.
_TEMP_NAME = re.compile(r"\..+\.ckpt\.[A-Za-z0-9_]+\.tmp")


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, quota, I/O error); the previous file is kept."""


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not private.is_local_path(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_atomically(Path(path), lambda f: torch.save(checkpoint, f))


def write_atomically(target: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `target` with `write(file)` through a temp file beside it, fsync'ed and renamed over
    it. Any failure leaves the previous `target` and no temp file; an OSError (disk full, ...)
    becomes a CheckpointWriteError that names the file and the cause on one line."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    try:
        # Mode 0o666 filtered by the umask (and a default ACL) is what a plain open() would
        # give a new file; mkstemp's 0o600 would hide checkpoints from the group.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    except OSError as e:
        raise _write_error(target, e) from e
    try:
        with os.fdopen(fd, "wb") as f:
            if target.exists():  # an overwrite keeps the file's mode, as open(target, "wb") would
                os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _write_error(target, e) from e
        raise
    _fsync_dir(target.parent)  # make the rename itself durable


def copy_atomically(source: Path, target: Path) -> None:
    with open(source, "rb") as src:
        write_atomically(target, lambda f: shutil.copyfileobj(src, f, 2**24))


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete the temp files that writes killed mid-way (SIGKILL, power loss) left under `folder`.
    Only safe while no other process writes there (the run dir lock); returns what was removed."""
    stale = [p for p in folder.rglob(".*.tmp") if _TEMP_NAME.fullmatch(p.name) and p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _write_error(target: Path, e: OSError) -> CheckpointWriteError:
    kept = "its previous version is kept" if target.exists() else "no earlier version existed"
    return CheckpointWriteError(f"cannot write {target}: {e.strerror or e}; {kept}")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
