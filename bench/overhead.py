"""What a callback costs: fit time with and without it, runs interleaved in one process.

    python -m bench.overhead experiment=cpu_quick data.data_dir=<folder>
    python -m bench.overhead --callback precision_diagnostics --repeats 4 [overrides]

Interleaving (with, without, with, ...) and taking medians keeps a shared, noisy machine's
drift out of the ratio; validation and test are off so only the training loop is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from cifar_amp import config
from cifar_amp.training import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def measure(callback: str, repeats: int, overrides: list[str]) -> dict:
    base = [
        *overrides,
        "logger=none",
        "test=false",
        "trainer.limit_val_batches=0",
        "trainer.enable_model_summary=false",
        "trainer.enable_progress_bar=false",
    ]
    runs = {"with": [], "without": []}
    config.register(CONFIGS)
    with (
        tempfile.TemporaryDirectory() as tmp,
        initialize_config_dir(str(CONFIGS), version_base="1.3"),
    ):
        for i in range(repeats):
            for name, extra in (("with", []), ("without", [f"~callbacks.{callback}"])):
                cfg = compose("train", overrides=[*base, *extra, f"run_dir={tmp}/{name}{i}"])
                runs[name].append(train(cfg)["fit_seconds"])
    w, wo = statistics.median(runs["with"]), statistics.median(runs["without"])
    return {
        "callback": callback,
        "overrides": overrides,
        "fit_seconds": runs,
        "median_with": w,
        "median_without": wo,
        "ratio_with_over_without": round(w / wo, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--callback",
        default="precision_diagnostics",
        help="a key of configs/callbacks/default.yaml",
    )
    parser.add_argument("--repeats", type=int, default=4)
    args, overrides = parser.parse_known_args()
    print(json.dumps(measure(args.callback, args.repeats, overrides), indent=2))


if __name__ == "__main__":
    main()
