"""A callback that proves jobs ran at once: each training process waits at fit start until
`parties` of them have arrived (a file each in `folder`). Jobs run one after the other fail
there, however loaded the machine; comparing their logs' time stamps did not (a job of a few
batches could end before the other started)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch import Callback


class Rendezvous(Callback):
    def __init__(self, folder: str, parties: int, timeout_s: float = 120) -> None:
        self.folder = Path(folder)
        self.parties = parties
        self.timeout_s = timeout_s

    def on_fit_start(self, trainer, pl_module) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / str(os.getpid())).touch()
        deadline = time.monotonic() + self.timeout_s
        arrived = len(list(self.folder.iterdir()))
        while arrived < self.parties:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{arrived} of {self.parties} jobs ran at once")
            time.sleep(0.05)
            arrived = len(list(self.folder.iterdir()))
