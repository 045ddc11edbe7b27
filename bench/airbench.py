"""The public speed-run script beside ours: airbench94 (KellerJordan/cifar10-airbench,
legacy/airbench94.py: eager, fp16, channels_last, batch 1024, 10 epochs) on the same GPU and the
same images as `experiment=speedrun_gpu`, for `make bench-gpu --airbench <airbench94.py>`. Its
own timer counts training only (CUDA events around each epoch's batches); it runs 25 times,
the first a warm-up, and is stopped once RUNS runs are read."""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.synthetic import SPEC

RUNS = 3  # the runs read (the first warms up), then it is stopped


def run(script: str | Path, data_dir: Path, work: Path, deadline: float) -> dict:
    """airbench94.py on the CIFAR-10 folder `data_dir`, in `work` (it reads
    `cifar10/{train,test}.pt` there); stopped after RUNS runs or at `deadline` (time.time())."""
    folder = work / "airbench"
    (folder / "cifar10").mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        x, y = SPEC.read(SPEC.find(data_dir), split)
        images = x.permute(0, 2, 3, 1).contiguous()  # NHWC uint8, as torchvision gives them
        saved = {
            "images": images,
            "labels": y,
            "classes": [str(i) for i in range(SPEC.num_classes)],
        }  # (unused)
        torch.save(saved, folder / "cifar10" / f"{split}.pt")
    command = [sys.executable, str(Path(script).resolve())]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:  # one line an epoch: the deadline is checked often enough
            lines.append(line)
            if "eval" in line and sum("eval" in x for x in lines) >= RUNS:
                break
            if deadline - time.time() < 2:
                break
    finally:
        proc.kill()
        proc.wait()
    return {"command": " ".join(command[1:])} | seconds_per_epoch("".join(lines))


def seconds_per_epoch(text: str) -> dict:
    """airbench94's seconds per epoch from its table (`total_time_seconds`: training time,
    cumulative within a run, after the whitening layer's set-up): from its first epoch's end to
    its last's, median over the runs after the first (the warm-up)."""
    runs: list[list[tuple[int, float]]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not re.fullmatch(r"\d+", cells[1]):
            continue
        if cells[0]:  # a run's first epoch names the run
            runs.append([])
        if runs:
            runs[-1].append((int(cells[1]), float(cells[6])))
    timed = [r for r in runs[1:] if len(r) > 1]
    per_epoch = [(r[-1][1] - r[0][1]) / (r[-1][0] - r[0][0]) for r in timed]
    return {
        "runs": len(runs),
        "epochs": [len(r) for r in runs],
        "seconds_per_epoch": statistics.median(per_epoch) if per_epoch else None,
    }
