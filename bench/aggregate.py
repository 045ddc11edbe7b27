"""`python -m bench.aggregate <multirun dir> [--metrics a,b]`: one table of a sweep.

Every job directory of a Hydra multirun (any sweeper: basic grid, Optuna, ...) holds its
overrides in `.hydra/overrides.yaml` and, once finished, `metrics.json`. This writes
`aggregate.md`, `aggregate.csv` and `aggregate.png` into the multirun dir: one row per job,
the overrides that differ between jobs as columns, then every numeric metric. Jobs without
metrics.json (failed or unfinished) are listed as such.

The jobs are read as the multirun extra's summary reads them (`python -m
cifar_amp.extras.multirun.summary <multirun dir>`, which every sweep writes at its end): that
one has a row per setting instead, the mean +- std (n) over its seeds and folds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import report
from cifar_amp import metrics
from cifar_amp.errors import UserError, reported
from cifar_amp.extras.diagnostics import diagnostics as D
from cifar_amp.extras.multirun import summary

DEFAULT_CHART = (
    metrics.TEST_ACC,
    metrics.VAL_ACC_BEST,
    D.IMAGES_PER_SEC,
    D.PEAK_MEMORY_MB,
)


def collect(sweep_dir: Path) -> list[dict]:
    """[{"job", "overrides": {key: value}, "metrics": {...} or None}] in job order."""
    jobs = [
        {
            "job": job.name,
            "overrides": {summary.key(o): o.partition("=")[2] for o in job.overrides},
            "metrics": job.result,
        }
        for job in summary.collect(sweep_dir)
    ]
    if not any(j["metrics"] is not None for j in jobs):
        raise UserError(
            f"{sweep_dir}: no job with .hydra/overrides.yaml and metrics.json (did the sweep run?)"
        )
    return jobs


def table(jobs: list[dict]) -> tuple[list[str], list[list], list[str], dict[str, str]]:
    """Columns, rows, the overrides that vary between jobs and those common to all."""
    keys = list(dict.fromkeys(k for j in jobs for k in j["overrides"]))
    varying = [k for k in keys if len({j["overrides"].get(k) for j in jobs}) > 1]
    common = {
        k: jobs[0]["overrides"][k] for k in keys if k not in varying and k in jobs[0]["overrides"]
    }
    numeric = list(
        dict.fromkeys(
            k
            for j in jobs
            for k, v in (j["metrics"] or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        )
    )
    rows = []
    for j in jobs:
        m = j["metrics"]
        status = "ok" if m is not None else "no metrics.json"
        rows.append(
            [
                j["job"],
                *(j["overrides"].get(k) for k in varying),
                *((m or {}).get(k) for k in numeric),
                status,
            ]
        )
    return ["job", *varying, *numeric, "status"], rows, varying, common


def write(sweep_dir: Path, chart_metrics: list[str] | None = None) -> list[dict]:
    jobs = collect(sweep_dir)
    columns, rows, varying, common = table(jobs)
    common_text = ", ".join(f"`{k}={v}`" for k, v in common.items()) or "none"
    (sweep_dir / "aggregate.md").write_text(
        f"# Sweep {sweep_dir}\n\n{len(jobs)} jobs; overrides common to all: {common_text}\n\n"
        + report.markdown(columns, rows)
    )
    report.write_csv(sweep_dir / "aggregate.csv", columns, rows)
    wanted = chart_metrics or [m for m in DEFAULT_CHART if m in columns]
    missing = [m for m in wanted if m not in columns]
    if missing:
        raise UserError(
            f"--metrics {','.join(missing)}: not in any job's metrics.json; there are: {', '.join(columns)}"
        )
    labels = [
        " ".join(f"{k}={v}" for k, v in zip(varying, row[1:], strict=False)) or row[0]
        for row in rows
    ]
    panels = [(m, {m: [row[columns.index(m)] for row in rows]}) for m in wanted]
    if panels:
        report.grouped_bars(sweep_dir / "aggregate.png", labels, panels)
    return jobs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.aggregate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("sweep_dir", type=Path, help="a Hydra multirun directory")
    parser.add_argument(
        "--metrics",
        help="comma-separated metrics.json keys to chart (default: accuracy, speed, memory)",
    )
    args = parser.parse_args(argv)
    with reported():
        write(args.sweep_dir, args.metrics.split(",") if args.metrics else None)
        print(f"wrote {args.sweep_dir}/aggregate.{{md,csv,png}}")


if __name__ == "__main__":
    main()
