"""What each part of the default recipe costs a training step: the template's steps against the
plain loop's (bench/reference_loop.py) for the same set-up, once with everything and once
with each part taken away, case after case in one process (bench/gpu.py's precision-section
machinery: one window of timed steps, the device synchronised at its ends).

    python -m bench.step_parts [--data-dir <CIFAR-10 folder>] [--modes bf16-mixed,16-mixed]
                               [--out step_parts.json]

On CUDA: ResNet-18, batch 512, each mode's default layout, 8 warm-up and 40 timed steps a case.
Without CUDA: the same cases at the dry run's sizes (SpeedNet 4,4,4, batch 16), where a step is
host work. Read the ratio (plain / template) of each case, not its milliseconds across cases:
the two loops of a case run back to back, the cases minutes apart.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# bench.gpu's cases turn these off (they write files); the hook skipper is plumbing that makes
# the others cheaper. Every other callback is a part.
KEPT = ("model_checkpoint", "last_checkpoint", "step_checkpoint", "skip_unused_hooks")
NO_CLIP = ["trainer.gradient_clip_val=null"]
FOREACH = ["module.optimizer.fused=false"]


def cases(callbacks) -> list[tuple[str, list[str]]]:
    """(label, overrides): what each case takes away from a config with `callbacks` (their
    keys: the default's, less those of extras a fork deleted). The default optimizer is fused:
    under 16-mixed a foreach one makes GradScaler read its inf flag on the host every step,
    where a fused one takes the flag on the device (its gradients unscaled before clipping:
    precision.py)."""
    parts = [k for k in callbacks if k not in KEPT]
    none = [f"~callbacks.{k}" for k in parts]
    diagnostics = [("no diagnostics", ["~callbacks.precision_diagnostics"])]
    return [
        ("everything", []),
        ("no callbacks", none),
        *(diagnostics if "precision_diagnostics" in parts else []),
        ("no clipping", NO_CLIP),
        ("no callbacks, no clipping", [*none, *NO_CLIP]),
        ("foreach SGD", FOREACH),
        ("foreach SGD, no clipping", [*FOREACH, *NO_CLIP]),
    ]


def measure(modes: list[str], data_source: str | None, out: Path | None) -> dict:
    import torch

    from bench import gpu as G
    from bench import synthetic

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sizes = G.Sizes.gpu() if cuda else G.Sizes.tiny()
    sizes.warmup, sizes.timed = (8, 40) if cuda else (2, 6)
    work = Path(tempfile.mkdtemp(prefix="step_parts_"))
    data_dir, images = synthetic.write(work / "data", sizes.images, sizes.images // 5, data_source)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run: tiny sizes)",
        "net": sizes.net,
        "batch": sizes.batch,
        "images": images,
        "cases": [],
    }
    datamodules, parts = {}, cases(G.compose([]).callbacks)
    for mode in modes:
        for label, overrides in parts:
            run_dir = work / f"{mode}-{len(result['cases'])}"
            base = G.case_overrides(sizes, data_dir, run_dir, device)
            cfg = G.compose([*base, f"precision={mode}", *overrides])
            row = {"mode": mode, "case": label, "overrides": overrides}
            row["template"] = G.lightning_steps(cfg, sizes, datamodules)
            G._release()
            row["plain"] = G.plain_steps(cfg, sizes, datamodules)
            G._release()
            t, p = row["template"].get("step_ms"), row["plain"].get("step_ms")
            row["ratio"] = p / t if t and p else None
            result["cases"].append(row)
            print(line(row), flush=True)
            if out:
                out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def line(row: dict) -> str:
    t, p = row["template"].get("step_ms"), row["plain"].get("step_ms")
    ms = (
        f"template {t:6.2f} ms, plain {p:6.2f} ms, ratio {row['ratio']:.3f}"
        if t and p
        else (row["template"].get("skipped") or row["plain"].get("skipped"))
    )
    return f"{row['mode']:11s} {row['case']:38s} {ms}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m bench.step_parts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--data-dir", help="a CIFAR-10 folder: its images, repeated (else random)")
    ap.add_argument("--modes", default="bf16-mixed,16-mixed", type=lambda s: s.split(","))
    ap.add_argument("--out", type=Path, help="the JSON, rewritten after each case")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    result = measure(args.modes, args.data_dir, args.out)
    print(
        f"{len(result['cases'])} cases on {result['device']} in {time.perf_counter() - start:.0f} s"
    )
    return result


if __name__ == "__main__":
    main()
