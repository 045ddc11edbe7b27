"""Tables (Markdown, CSV) and bar charts (PNG) that the benchmark commands write."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Sequence


def fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"
    return str(value)


def markdown(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        w.writerows(["" if v is None else v for v in row] for row in rows)


def grouped_bars(
    path: Path,
    categories: Sequence[str],
    panels: Sequence[tuple[str, dict[str, Sequence[float | None]]]],
    reference_line: float | None = None,
) -> None:
    """One panel per (title, {series: one value per category}); missing values draw no bar.
    matplotlib is imported here, so that the tables need only the standard library."""
    # The object API, not pyplot: no global backend or figure registry, and no display needed.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6, 1.3 * len(categories)), 3.2 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)
    for ax, (title, series) in zip(axes[:, 0], panels, strict=False):
        width = 0.8 / max(1, len(series))
        for i, (label, values) in enumerate(series.items()):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(categories))]
            ys = [math.nan if v is None else v for v in values]
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(
                bars, labels=[fmt(v, 2) if v is not None else "" for v in values], fontsize=7
            )
        if reference_line is not None:
            ax.axhline(reference_line, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(categories)), categories, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        if len(series) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
