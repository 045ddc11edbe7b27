"""Jobs run one after another, each in a process of its own within a share of a time budget:
one that runs past its share is killed (its process group, so its own subprocesses too) and
recorded as cut, after what it reported so far; the results are saved after each job, so a
run killed midway keeps what it finished. `make bench-gpu` (bench/gpu.py) runs its sections so."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path


def run_sections(jobs: list, budget: float, data: dict, save, folder: Path, start_method: str):
    """Run each job (name, share, fn, arg) as `fn(arg, keep)` in a process of its own (started
    by `start_method`: CUDA cannot be forked, so "spawn"; on CPU "forkserver": each child is a
    fork, imports done, of a server that imported torch and Lightning once, not of this process,
    which may have run a backward pass already, after which a fork's cannot run), given
    `share` / (the shares left) of what is left of `budget` seconds; `save(data)` after each.
    An `arg` with a `deadline` attribute gets its deadline (time.time()). A job still running
    then is killed (its process group: its own subprocesses too) and recorded in `data["cut"]`,
    with what it passed to `keep` so far as its result; one that raised (or died), in
    `data["failed"]`."""
    start = time.perf_counter()
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(
            ["torch", "lightning", *{fn.__module__ for _, _, fn, _ in jobs}]
        )
    shares = sum(share for _, share, *_ in jobs)
    for name, share, fn, arg in jobs:
        limit = max(0.0, budget - (time.perf_counter() - start)) * share / shares
        shares -= share
        if hasattr(arg, "deadline"):
            arg.deadline = time.time() + limit
        began = time.perf_counter()
        result, status = _in_child(fn, arg, folder / f"{name}.json", limit, context)
        took = time.perf_counter() - began
        if result is not None:
            data[name] = result
        data.setdefault("section_seconds", {})[name] = round(took, 1)
        if status == "cut":
            data.setdefault("cut", {})[name] = f"cut by the deadline after {took:.0f} s"
        elif status != "done":
            data.setdefault("failed", {})[name] = status
        save(data)


def _in_child(fn, arg, path: Path, limit: float, context) -> tuple[object, str]:
    """(what the child kept or returned, "done" | "cut" | why it failed)."""
    path.unlink(missing_ok=True)
    proc = context.Process(target=_child, args=(fn, arg, path))
    proc.start()
    try:
        proc.join(limit)
    finally:  # also when this process is told to stop (SIGTERM: see main)
        cut = proc.is_alive()
        if cut:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # before its setpgrp
                proc.kill()
            proc.join()
    saved = json.loads(path.read_text()) if path.is_file() else {}
    status = "cut" if cut else saved.get("status", "partial")
    if status == "partial":  # it died without a word (a signal, a crash in C)
        status = f"ended with exit code {proc.exitcode} before it finished"
    return saved.get("result"), status


def _child(fn, arg, path: Path) -> None:
    os.setpgrp()  # a group of its own: killing it kills its subprocesses (train.py, pytest)
    if getattr(arg, "device", None) == "cpu":
        # Tiny networks: a second thread's waits on a busy CPU cost more than it adds; and one
        # thread is what keeps torch's intra-op pool out of a forked process's way.
        import torch

        torch.set_num_threads(1)

    def keep(result, status="partial") -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"status": status, "result": result}, default=str))
        os.replace(tmp, path)  # a kill mid-write leaves the previous version

    try:
        keep(fn(arg, keep), "done")
    except BaseException as e:
        keep(json.loads(path.read_text())["result"] if path.is_file() else None, repr(e)[:300])
        raise
