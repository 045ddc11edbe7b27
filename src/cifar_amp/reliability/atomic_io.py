"""Checkpoint writes that a kill cannot tear.

Why not Lightning's TorchCheckpointIO alone: it writes through an fsspec transaction, which
stages the file in the system temp dir and then `shutil.move`s it; when /tmp is another
filesystem (the usual case on clusters) that move is a copy into the final path, so a kill
mid-copy leaves a truncated last.ckpt, and nothing is fsync'ed. Here the temp file sits next
to the target, is fsync'ed, and `os.replace` swaps it in: readers see the old file or the
new one, never a part. Remote paths (s3://, ...) keep Lightning's behaviour.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)  # make the rename itself durable


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
