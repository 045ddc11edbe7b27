"""`python -m cifar_amp.extras.multirun.summary <sweep dir> [--metrics a,b]`: a sweep's jobs as
one result per setting.

A sweep's jobs are grouped by their overrides, all but those that repeat a setting rather than
change it (EXEMPT: the seed, the fold): `-m precision=32-true,bf16-mixed seed=0,1,2` is two
groups of three. For each group and each numeric metric of the jobs' metrics.json this writes
the mean, the sample standard deviation (n-1) and n, the jobs that have that metric, into
`summary.md`, `summary.csv` and `summary.png` (error bars: that std) in the sweep's directory,
and names the failed jobs (those with an `error.txt`, multirun.py). SweepSummary does this at the
end of every `-m` sweep (grid, Optuna, folds) and prints the short table.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from cifar_amp import metrics
from cifar_amp.errors import EXIT_CODE, UserError, one_line, reported
from cifar_amp.extras.multirun.multirun import ERROR_FILE
from cifar_amp.runs import write_atomically, write_text

EXEMPT = ("seed", "data.fold")  # override keys a group's jobs repeat over: not a setting
BEST = re.compile(r"val/(\w+)_best")  # metrics.best(name), the best value of a monitored metric
FIRST_FEW = 3  # where no job monitored a metric: how many of the first metrics stand in
NAME = "summary"  # summary.md, summary.csv, summary.png
OVERRIDES = Path(".hydra") / "overrides.yaml"  # in each job's directory (Hydra's)
RESULT = "metrics.json"  # in a finished job's directory (runs.py)


@dataclass(frozen=True)
class Job:
    name: str  # its directory's name in the sweep's
    overrides: tuple[str, ...]  # as given on the command line: "precision=bf16-mixed", "+a.b=1"
    result: dict | None  # its metrics.json; None where it wrote none
    error: str | None  # its error.txt: it failed


@dataclass(frozen=True)
class Stat:
    mean: float  # NaN or inf where a job's value is (a loss that diverged)
    std: float | None  # sample standard deviation (n-1); None where n = 1, NaN where not finite
    n: int  # the group's jobs that have the metric


@dataclass(frozen=True)
class Group:
    overrides: tuple[str, ...]  # its jobs' overrides but the EXEMPT ones
    jobs: tuple[Job, ...]

    def stat(self, metric: str) -> Stat | None:
        values = [j.result[metric] for j in self.jobs if is_number((j.result or {}).get(metric))]
        if not values:
            return None
        std = None
        if len(values) > 1:
            # statistics.stdev fails on a NaN or an inf, where the spread is not a number
            std = statistics.stdev(values) if all(map(math.isfinite, values)) else math.nan
        return Stat(statistics.mean(values), std, len(values))

    def failed(self) -> list[Job]:
        return [j for j in self.jobs if j.error is not None]


def key(override: str) -> str:
    """The config key an override sets: `+a.b=1` -> `a.b`."""
    return override.lstrip("+~").partition("=")[0]


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def job_order(job_dir: Path) -> tuple:
    """Hydra numbers a sweep's jobs 0, 1, ...: 10 after 9; other names after them."""
    return (0, int(job_dir.name), "") if job_dir.name.isdigit() else (1, 0, job_dir.name)


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's jobs' folders, in job order: those with Hydra's overrides.yaml or an
    error.txt (a job that failed before it started has only that)."""
    if not sweep_dir.is_dir():
        return []
    found = [d for d in sweep_dir.iterdir() if (d / OVERRIDES).is_file()]
    found += [d for d in sweep_dir.iterdir() if (d / ERROR_FILE).is_file() and d not in found]
    return sorted(found, key=job_order)


def read_job(job_dir: Path) -> Job:
    overrides = OmegaConf.load(job_dir / OVERRIDES) if (job_dir / OVERRIDES).is_file() else []
    error = job_dir / ERROR_FILE
    return Job(
        job_dir.name,
        tuple(str(o) for o in overrides),
        read_result(job_dir / RESULT),
        error.read_text().strip() if error.is_file() else None,
    )


def read_result(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"{path}: not JSON ({one_line(e)})") from None


def collect(sweep_dir: Path) -> list[Job]:
    """The jobs of `sweep_dir`, or a UserError saying why it is no sweep's directory."""
    if not sweep_dir.is_dir():
        raise UserError(
            f"{sweep_dir}: no such directory (give a sweep's, e.g. logs/train/multiruns/<time>)"
        )
    if (sweep_dir / OVERRIDES).is_file():
        raise UserError(
            f"{sweep_dir}: the directory of one run, not of a sweep (a sweep's holds one "
            "directory per job)"
        )
    found = job_dirs(sweep_dir)
    if not found:
        raise UserError(f"{sweep_dir}: not a sweep's directory: no <job>/{OVERRIDES} in it")
    return [read_job(d) for d in found]


def group(jobs: Sequence[Job]) -> list[Group]:
    """Jobs with the same overrides but the EXEMPT ones, in the order of their first job."""
    by_setting: dict[tuple[str, ...], list[Job]] = {}
    for job in jobs:
        setting = tuple(o for o in job.overrides if key(o) not in EXEMPT)
        by_setting.setdefault(setting, []).append(job)
    return [Group(setting, tuple(members)) for setting, members in by_setting.items()]


def varying(override_sets: Sequence[Sequence[str]]) -> list[str]:
    """The overrides that some of the sets lack, in order of first appearance. An empty set
    (a job that failed before Hydra wrote its overrides) is left out: it is unknown."""
    known = [s for s in override_sets if s]
    every = list(dict.fromkeys(o for s in known for o in s))
    return [o for o in every if not all(o in s for s in known)]


def numeric_metrics(jobs: Sequence[Job]) -> list[str]:
    """The metrics.json keys holding a number in some job (per-class dicts, names: not)."""
    found = (k for j in jobs for k, v in (j.result or {}).items() if is_number(v))
    return list(dict.fromkeys(found))


def chosen_metrics(jobs: Sequence[Job], asked: Sequence[str]) -> list[str]:
    """`asked`, each a numeric metric of some job; by default those of the monitored metric, else the first few."""
    present = numeric_metrics(jobs)
    missing = [m for m in asked if m not in present]
    if missing:
        raise UserError(
            f"--metrics {','.join(missing)}: no job's metrics.json has a number for it; "
            f"there are: {', '.join(present) or 'none'}"
        )
    return list(asked) or monitored(present) or present[:FIRST_FEW]


def monitored(present: list[str]) -> list[str]:
    """The short table's and the chart's metrics: of each metric a run monitored (its
    `val/<name>_best`: config.Monitor), the test value and the best validation value."""
    names = [found.group(1) for found in map(BEST.fullmatch, present) if found]
    return [k for n in names for k in (metrics.key("test", n), metrics.best(n)) if k in present]


def fmt(value: float | None) -> str:
    """3 significant digits, the integer part whole: 0.367, 1234."""
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def cell(stat: Stat | None) -> str:
    """`mean +- std (n)`; `mean (1)` for one job; `-` for none."""
    if stat is None:
        return "-"
    spread = f" +- {fmt(stat.std)}" if stat.std is not None else ""
    return f"{fmt(stat.mean)}{spread} ({stat.n})"


def failed_cell(group: Group) -> str:
    names = [j.name for j in group.failed()]
    if not names:
        return "0"
    return f"{len(names)} (job{'s' if len(names) > 1 else ''} {', '.join(names)})"


def markdown(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def labels(groups: Sequence[Group], sep: str = " ") -> list[str]:
    """Each group's overrides that are not every group's ("all jobs" where none differ)."""
    differ = set(varying([g.overrides for g in groups]))
    alone = "all jobs" if len(groups) == 1 else "no overrides of its own"
    return [sep.join(o for o in g.overrides if o in differ) or alone for g in groups]


def short_table(groups: Sequence[Group], shown: Sequence[str]) -> str:
    """One row per group: its overrides, jobs, failed ones, `mean +- std (n)` of `shown`."""
    rows = [
        [label, str(len(g.jobs)), failed_cell(g), *(cell(g.stat(m)) for m in shown)]
        for label, g in zip(labels(groups), groups, strict=True)
    ]
    return markdown(["group", "jobs", "failed", *shown], rows)


def every_metric_table(groups: Sequence[Group], names: Sequence[str]) -> str:
    """One row per metric, one column per group: the metrics are many, the groups few."""
    rows = [[m, *(cell(g.stat(m)) for g in groups)] for m in names]
    return markdown(["metric", *labels(groups)], rows)


def job_label(job: Job, jobs: Sequence[Job]) -> str:
    """`job 3 (precision=bf16-mixed seed=1)`: its overrides that not every job has."""
    differ = set(varying([j.overrides for j in jobs]))
    return f"job {job.name} ({' '.join(o for o in job.overrides if o in differ)})"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def repeated(jobs: Sequence[Job]) -> str:
    """The EXEMPT overrides of the jobs, `seed=0,1,2`; "none" where they have none."""
    values: dict[str, list[str]] = {}
    for job in jobs:
        for override in job.overrides:
            if key(override) in EXEMPT:
                values.setdefault(key(override), []).append(override.partition("=")[2])
    said = [f"`{k}={','.join(dict.fromkeys(v))}`" for k, v in values.items()]
    return " ".join(said) or "none"


def report(
    sweep_dir: Path, jobs: Sequence[Job], groups: Sequence[Group], shown: Sequence[str]
) -> str:
    """summary.md's text."""
    common = [o for o in groups[0].overrides if o not in varying([g.overrides for g in groups])]
    failed = [j for j in jobs if j.error is not None]
    lacking = [j for j in jobs if j.result is None and j.error is None]
    lines = [
        f"# Sweep {sweep_dir}",
        "",
        f"{plural(len(jobs), 'job')} in {plural(len(groups), 'group')} (jobs that differ only "
        f"in {' or '.join(EXEMPT)} are one group: here {repeated(jobs)}); {len(failed)} "
        f"failed, {len(lacking)} without {RESULT} or {ERROR_FILE} (unfinished or killed).",
        f"Overrides common to all groups: {', '.join(f'`{o}`' for o in common) or 'none'}.",
        "",
        "Each cell: mean +- std (n) over the group's jobs that have the metric; std is the "
        "sample standard deviation (n-1), left out where n = 1.",
        "",
        short_table(groups, shown),
        "## Every numeric metric",
        "",
        every_metric_table(groups, numeric_metrics(jobs)),
    ]
    if failed or lacking:
        lines += ["## Jobs without a result", ""]
        lines += [f"- {job_label(j, jobs)}: {j.error}" for j in failed]
        lines += [f"- {job_label(j, jobs)}: no {RESULT}, no {ERROR_FILE}" for j in lacking]
    return "\n".join(lines) + "\n"


def csv_text(groups: Sequence[Group], names: Sequence[str]) -> str:
    """One row per group: a column per override key that differs, then jobs, failed,
    failed_jobs, and <metric>_mean, _std, _n for every numeric metric."""
    differ = varying([g.overrides for g in groups])
    keys = list(dict.fromkeys(key(o) for o in differ))
    out = io.StringIO()
    writer = csv.writer(out)
    stats = [f"{m}_{part}" for m in names for part in ("mean", "std", "n")]
    writer.writerow([*keys, "jobs", "failed", "failed_jobs", *stats])
    for g in groups:
        values = {key(o): o.partition("=")[2] for o in g.overrides}
        row = [values.get(k, "") for k in keys]
        row += [len(g.jobs), len(g.failed()), " ".join(j.name for j in g.failed())]
        for m in names:
            stat = g.stat(m)
            if stat is None:
                row += ["", "", 0]
            else:
                row += [stat.mean, "" if stat.std is None else stat.std, stat.n]
        writer.writerow(row)
    return out.getvalue()


def chart(path: Path, groups: Sequence[Group], shown: Sequence[str]) -> None:
    """One panel per metric of `shown`: a bar per group, its mean, error bar its std."""
    # The object API on the Agg canvas: no global backend or figure registry, no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = labels(groups, sep="\n")
    fig = Figure(figsize=(max(6, 1.3 * len(groups)), 3.4 * len(shown)))
    axes = fig.subplots(len(shown), 1, squeeze=False)[:, 0]
    for ax, metric in zip(axes, shown, strict=True):
        stats = [g.stat(metric) for g in groups]
        means = [math.nan if s is None else s.mean for s in stats]
        stds = [s.std if s and s.std is not None and math.isfinite(s.std) else 0.0 for s in stats]
        bars = ax.bar(range(len(groups)), means, 0.6, yerr=stds, capsize=4, color="C0")
        ax.bar_label(bars, labels=[cell(s) for s in stats], fontsize=7, label_type="center")
        ax.set_xticks(range(len(groups)), names, fontsize=8)
        ax.set_title(f"{metric}: mean, error bar: sample std (n-1)", fontsize=10)
    fig.tight_layout()
    write_atomically(path, FigureCanvasAgg(fig).print_png)


def write(sweep_dir: Path, asked: Sequence[str] = ()) -> tuple[str, str]:
    """Write summary.md, .csv and .png into `sweep_dir` (refused before any is written):
    (the short table, the files written)."""
    return write_jobs(sweep_dir, collect(sweep_dir), asked)


def write_jobs(sweep_dir: Path, jobs: Sequence[Job], asked: Sequence[str] = ()) -> tuple[str, str]:
    """write() of `jobs`, the sweep's. No chart where no job has a number to draw."""
    groups = group(jobs)
    shown = chosen_metrics(jobs, asked)
    write_text(sweep_dir / f"{NAME}.md", report(sweep_dir, jobs, groups, shown))
    write_text(sweep_dir / f"{NAME}.csv", csv_text(groups, numeric_metrics(jobs)))
    files = f"{sweep_dir / NAME}.md, .csv"
    if shown:
        chart(sweep_dir / f"{NAME}.png", groups, shown)
        files += ", .png"
    return short_table(groups, shown), files


class SweepSummary(Callback):
    """At the end of a sweep: write its summary (above) and print the short table; name the
    failed jobs on stderr and exit 2 if there were any."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        root = Path(config.hydra.sweep.dir)
        if not job_dirs(root):  # no job ran
            return
        with reported():  # a metrics.json that is no JSON, a full disk: one line, exit 2
            jobs = collect(root)
            table, files = write_jobs(root, jobs)
        print(f"Sweep summary ({files}):\n{table}", end="")
        failed = [j for j in jobs if j.error is not None]
        if not failed:
            return
        lines = [f"error: {len(failed)} job(s) of the sweep in {root} failed:"]
        lines += [f"  {job_label(j, jobs)}: {j.error}" for j in failed]
        print("\n".join(lines), file=sys.stderr)
        sys.exit(EXIT_CODE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cifar_amp.extras.multirun.summary", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("sweep_dir", type=Path, help="a sweep's directory (Hydra's -m)")
    parser.add_argument(
        "--metrics",
        help="comma-separated metrics.json keys for the printed table and the chart "
        "(default: test/<m> and val/<m>_best of the metric m the runs monitored)",
    )
    args = parser.parse_args(argv)
    with reported():
        table, files = write(args.sweep_dir, args.metrics.split(",") if args.metrics else ())
    print(table, end="")
    print(f"wrote {files}")


if __name__ == "__main__":
    main()
