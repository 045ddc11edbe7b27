"""How long a checkpoint holds up the training thread: the reliability extra's atomic writer on
that thread (`trainer/reliability@trainer=sync`) against its default, the same writer on a background
thread, which leaves the training thread a copy of the tensors to make.

    python -m bench.checkpoint_stall                   # ResNet-18 with SGD momentum, on the CPU
    python -m bench.checkpoint_stall --device cuda

Each save is a ResNet-18 checkpoint as Lightning hands it over (the weights and the optimizer's
momentum), written into a temporary folder (`--dir` to choose the disk). Per save: the time
from the call to its return on the training thread, and, for the background writer, the time
until the file has landed. Medians over `--saves` saves each, the two writers in turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cifar_amp.extras.reliability.reliability import AtomicCheckpointIO, BackgroundCheckpointIO
from cifar_amp.extras.resnet18.resnet import ResNet18


def checkpoint(device: str) -> dict:
    net = ResNet18(num_classes=10).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 32, 32, device=device)).sum().backward()
    opt.step()  # momentum buffers, as in every checkpoint after the first step
    return {"state_dict": net.state_dict(), "optimizer_states": [opt.state_dict()]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--dir", type=Path, default=None, help="where to write (a temp folder)")
    args = p.parse_args(argv)
    ckpt, sync = checkpoint(args.device), torch.cuda.synchronize if "cuda" in args.device else None
    times: dict[str, list[float]] = {"sync": [], "background": [], "background_landed": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        writers = {"sync": AtomicCheckpointIO(), "background": BackgroundCheckpointIO()}
        for i in range(args.saves + 1):  # the first of each: a warm-up
            for name, io in writers.items():
                if sync:
                    sync()
                start = time.perf_counter()
                io.save_checkpoint(ckpt, Path(tmp) / f"{name}.ckpt")
                returned = time.perf_counter()
                if isinstance(io, BackgroundCheckpointIO):
                    io.wait()
                if i:
                    times[name].append(returned - start)
                    if name == "background":
                        times["background_landed"].append(time.perf_counter() - start)
        size = (Path(tmp) / "sync.ckpt").stat().st_size
        writers["background"].teardown()
    ms = {k: round(statistics.median(v) * 1000, 1) for k, v in times.items()}
    result = {"device": args.device, "checkpoint_mb": round(size / 1e6, 1), "median_ms": ms}
    result["training_thread_ratio"] = round(ms["sync"] / ms["background"], 1)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
