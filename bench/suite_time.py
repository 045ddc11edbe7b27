"""Wall time of a command over several runs, alone or side by side with another (A B A B ...,
so that a busy machine slows both alike): the figures docs/benchmarks.md gives for the test
suites and CI.

    python -m bench.suite_time --runs 3 -- make test
    python -m bench.suite_time --runs 2 --vs "git stash && make test; git stash pop" -- make test
    python -m bench.suite_time --runs 1 --out ci.json -- env CI=true bash .ci/run

It prints each run's seconds and exit status, then the minimum, median and maximum of each
command (and their ratio, with --vs); --out writes the same as JSON. A run that fails counts,
and says so: a suite's time means little if it did not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(command: list[str]) -> tuple[float, int]:
    """(wall seconds, exit status) of `command`, run from the repository root, its output kept
    out of the way (the last lines are printed if it fails)."""
    start = time.perf_counter()
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if run.returncode:
        tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
        print("\n".join(f"    | {line}" for line in tail), file=sys.stderr)
    return seconds, run.returncode


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "min": round(min(seconds), 3),
        "median": round(statistics.median(seconds), 3),
        "max": round(max(seconds), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.suite_time", description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="runs of each command (default 3)")
    parser.add_argument("--vs", help="a second command, as one shell line, timed in turn")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.runs < 1:
        parser.error("give --runs >= 1 and a command after --")
    commands = {"A": command} | ({"B": ["bash", "-c", args.vs]} if args.vs else {})
    runs: dict[str, list] = {name: [] for name in commands}
    for i in range(args.runs):
        for name, cmd in commands.items():
            seconds, status = timed(cmd)
            runs[name].append({"seconds": round(seconds, 3), "exit": status})
            print(f"run {i + 1} {name}: {seconds:.1f} s, exit {status}", flush=True)
    result = {
        "commands": {name: shlex.join(cmd) for name, cmd in commands.items()},
        "cpu": os.cpu_count(),
        "runs": runs,
        "seconds": {name: summary([r["seconds"] for r in rs]) for name, rs in runs.items()},
    }
    if args.vs:
        a, b = (result["seconds"][n]["median"] for n in ("A", "B"))
        result["median_ratio_a_to_b"] = round(a / b, 2) if b else None
    print(json.dumps(result["seconds"] | {"ratio": result.get("median_ratio_a_to_b")}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
