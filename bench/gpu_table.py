"""The table of `make bench-gpu` (bench/gpu.py): each promise's target, what was measured and
whether it holds; and the record it writes: header, table, details, chart, raw JSON, and the
doc section between two markers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

START = "<!-- bench-gpu record: start (written by `make bench-gpu`; edits inside are lost) -->"
END = "<!-- bench-gpu record: end -->"
# Targets (issue 27; docs/benchmarks-gpu.md).
TEMPLATE_RATIO = 0.97  # template / plain loop, images/s, each mode and layout
BEST_16BIT = 0.95  # the template's best 16-bit mode over the plain loop's best, images/s
LAYOUT_SLACK = 1.02  # each mode's default layout: at most 2% slower than its other one
AUTO_WITHIN = 0.95  # precision=auto's choice: within 5% of the table's fastest finite mode
RATIO = 0.95  # Lightning / plain (bench.framework), images/s
MIXED_MEMORY = 0.6  # 16-bit modes' step peak over 32-true's, same layout
CKPT_MEMORY = 0.75  # the best checkpointing setting's step peak over none's
HOST_STEP_MS = 4.0  # airbench94's whole GPU step at batch 1024 on an H100
HOST_EXTRA_MS = 1.0  # Lightning's extra host work per step
FIT_OVER_TRAIN = 1.5  # speedrun_gpu: fit_seconds (compile included) over train_seconds
GPU_TESTS_S = 180.0  # `pytest -m gpu`


def _fmt(value, unit: str = "", digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def _holds(ok) -> str:
    return "-" if ok is None else ("yes" if ok else "no")


def rows(data: dict) -> list[tuple[str, str, str]]:
    """(target, measured, holds) for every promise; `holds` is "-" where nothing was measured.
    A section cut by the deadline (or failed) has a row saying so, after its finished cases."""
    out = []
    for name in ROWS:
        if name in data or name in data.get("cut", {}) or name in data.get("failed", {}):
            out += ROWS[name](data) if name in data else []
            if name in data.get("cut", {}):
                out.append((f"`{name}` ends within its share of --budget", data["cut"][name], "no"))
            if name in data.get("failed", {}):
                out.append((f"`{name}` runs", f"failed: {data['failed'][name]}", "no"))
    return out


def _precision_rows(data: dict) -> list:
    out = []
    model, batch = data["sizes"]["net"], data["sizes"]["batch"]
    prec = {(r["mode"], r["channels_last"]): r for r in data["precision"]}
    for (mode, cl), r in prec.items():
        lt, pl = r["lightning"], r["plain"]
        layout = "channels_last" if cl else "NCHW"
        target = (
            f"{model} b{batch} {mode} {layout}: template >= {TEMPLATE_RATIO} x plain loop, img/s"
        )
        if "skipped" in lt or "skipped" in pl:
            out.append((target, f"skipped: {lt.get('skipped') or pl.get('skipped')}", "-"))
            continue
        ratio = lt["images_per_sec"] / pl["images_per_sec"]
        out.append(
            (
                target,
                f"template {_fmt(lt['images_per_sec'])} img/s, step peak "
                f"{_fmt(lt.get('step_peak_mb'))} MB; plain {_fmt(pl['images_per_sec'])} img/s, "
                f"{_fmt(pl.get('step_peak_mb'))} MB; ratio {ratio:.2f}",
                _holds(ratio >= TEMPLATE_RATIO),
            )
        )

    def get(loop, mode, cl, key):
        return prec.get((mode, cl), {}).get(loop, {}).get(key)

    speed = {k: get("lightning", *k, "images_per_sec") for k in prec}
    plain = {k: get("plain", *k, "images_per_sec") for k in prec}
    mixed = {k: v for k, v in speed.items() if v and k[0] in ("16-mixed", "bf16-mixed")}
    best = max(mixed, key=mixed.get) if mixed else None
    ref = max((k for k in plain if plain[k]), key=plain.get, default=None)
    gain = mixed[best] / plain[ref] if best and ref else None
    out.append(
        (
            f"mixed precision pays: the template's best 16-bit mode >= {BEST_16BIT} x the plain "
            "loop's best mode, img/s",
            f"{_case(best)} {_fmt(mixed[best])} vs plain {_case(ref)} {_fmt(plain[ref])} "
            f"({gain:.2f})"
            if gain
            else "-",
            _holds(gain >= BEST_16BIT if gain else None),
        )
    )
    ratios = {}
    for mode, cl in prec:
        fp32 = get("lightning", "32-true", cl, "step_peak_mb")
        mine = get("lightning", mode, cl, "step_peak_mb")
        if mode in ("16-mixed", "bf16-mixed") and fp32 and mine:
            ratios[(mode, cl)] = mine / fp32
    out.append(
        (
            f"16-bit modes' step peak memory <= {MIXED_MEMORY} x 32-true's (same layout), template",
            "; ".join(f"{_case(k)} {v:.2f}" for k, v in ratios.items()) or "-",
            _holds(max(ratios.values()) <= MIXED_MEMORY if ratios else None),
        )
    )
    checks = []
    for mode in ("32-true", "16-mixed", "bf16-mixed"):
        faster = {cl: speed.get((mode, cl)) for cl in (False, True)}
        if None in faster.values() or mode not in data["defaults"]:
            continue
        default = data["defaults"][mode]
        checks.append((mode, default, faster[default] * LAYOUT_SLACK >= max(faster.values())))
    out.append(
        (
            f"each mode's default layout is its faster one (within {LAYOUT_SLACK - 1:.0%})",
            ", ".join(
                f"{m}: {'channels_last' if d else 'NCHW'} {'ok' if ok else 'slower'}"
                for m, d, ok in checks
            )
            or "-",
            _holds(all(ok for *_, ok in checks) if checks else None),
        )
    )
    return out


def _case(key) -> str:
    return f"{key[0]} {'channels_last' if key[1] else 'NCHW'}" if key else "-"


def _checkpointing_rows(data: dict) -> list:
    ckpt = [r for r in data["checkpointing"] if r.get("step_peak_mb")]
    none = next((r for r in ckpt if r["setting"] == "none"), None)
    target = f"activation checkpointing, best setting: step peak memory <= {CKPT_MEMORY} x none's"
    others = [r for r in ckpt if r is not none]
    if not none or not others:
        return [(target, "-", "-")]
    best = min(others, key=lambda r: r["step_peak_mb"])
    mem, slower = best["step_peak_mb"] / none["step_peak_mb"], best["step_ms"] / none["step_ms"]
    measured = (
        f"{best['setting']}: {_fmt(best['step_peak_mb'])} vs {_fmt(none['step_peak_mb'])} MB "
        f"({mem:.2f}), {best['step_ms']:.1f} vs {none['step_ms']:.1f} ms ({slower:.2f} x)"
    )
    return [(target, measured, _holds(mem <= CKPT_MEMORY))]


def _auto_rows(data: dict) -> list:
    auto, batch = data["auto"], data["sizes"]["batch"]
    cl = auto["channels_last"]
    table = {}
    for r in data.get("precision", []):
        if r["channels_last"] == cl and r["mode"] in auto["candidates"]:
            table[r["mode"]] = r["lightning"].get("images_per_sec")
    finite = [m for m in table if table[m] and auto["finite"].get(m)]
    fastest = max(finite, key=table.get) if finite else None
    agrees = table.get(auto["chosen"]) or 0
    ok = agrees >= AUTO_WITHIN * table[fastest] if fastest else None
    probed = ", ".join(f"{m} {_fmt(v)}" for m, v in auto["images_per_sec"].items())
    return [
        (
            f"precision=auto: probes at the run's batch ({batch}) within its budget and picks a "
            f"mode within {1 - AUTO_WITHIN:.0%} of the fastest finite one of the table above",
            f"{auto['chosen']} in {auto['seconds']:.1f} s at batch {auto.get('probe_batch')} "
            f"(probe img/s: {probed}; table's fastest: {fastest})",
            _holds(
                None
                if ok is None
                else ok
                and auto["seconds"] <= auto["budget"] + 2
                and auto.get("probe_batch") == batch
            ),
        )
    ]


def _framework_rows(data: dict) -> list:
    out = []
    for case in data["framework"]:
        target = f"Lightning / plain >= {RATIO}: {case['case']}"
        if "skipped" in case:
            out.append((target, f"not run ({case['skipped']})", "-"))
            continue
        ratio = case["ratio_lightning_over_plain"]
        out.append(
            (
                target,
                f"plain {_fmt(case['plain_images_per_s'])} img/s, Lightning "
                f"{_fmt(case['lightning_images_per_s'])} img/s ({ratio:.3f}); "
                f"Lightning {case['lightning_s_per_epoch']:.3f} s/epoch",
                _holds(ratio >= RATIO),
            )
        )
    return out


def _host_rows(data: dict) -> list:
    host = data["host"]
    ms = host["ms_per_step"]
    extra = host["lightning_extra_ms_per_step"]
    return [
        (
            f"host work of a recipe step (Lightning, module, every callback) <= "
            f"{HOST_STEP_MS} ms (airbench94's H100 step at batch 1024)",
            f"{ms['lightning']:.2f} ms (plain loop {ms['plain']:.2f} ms; tiny net)",
            _holds(ms["lightning"] <= HOST_STEP_MS),
        ),
        (
            f"Lightning's extra host work per step <= {HOST_EXTRA_MS} ms",
            f"{extra:.2f} ms",
            _holds(extra <= HOST_EXTRA_MS),
        ),
    ]


def _speedrun_rows(data: dict) -> list:
    run, images = data["speedrun"], data["sizes"]["images"]
    if "failed" in run:
        return [("experiment=speedrun_gpu runs", f"failed: {run['failed']}", "no")]
    train, fit, epochs = run.get("train_seconds"), run.get("fit_seconds"), run.get("epochs")
    per_epoch = train / epochs if train and epochs else None
    theirs = run.get("airbench94", {})
    their_epoch = theirs.get("seconds_per_epoch")
    if their_epoch:
        versus = f"airbench94 {their_epoch:.3f} s ({theirs['runs']} runs, the first a warm-up)"
    else:
        versus = f"airbench94 not run ({theirs.get('skipped', 'no time left')})"
    return [
        (
            f"experiment=speedrun_gpu: an epoch of {images:,} images <= airbench94's, same GPU "
            "and images",
            f"{_fmt(per_epoch, ' s', 3)} (train_seconds {_fmt(train, '', 2)} / {epochs} epochs); "
            f"{versus}",
            _holds(per_epoch <= their_epoch if per_epoch and their_epoch else None),
        ),
        (
            f"speedrun_gpu: fit_seconds (compile included) <= {FIT_OVER_TRAIN} x train_seconds",
            f"fit {_fmt(fit, ' s', 2)}, train {_fmt(train, ' s', 2)}, compile "
            f"{_fmt(run.get('compile_seconds'), ' s', 2)}",
            _holds(fit <= FIT_OVER_TRAIN * train if fit and train else None),
        ),
    ]


def _tests_rows(data: dict) -> list:
    out = []
    for name, label in (("gpu", "`pytest -m gpu`"), ("default", "the default test suite")):
        t = data["tests"].get(name)
        if t is None:
            continue
        within = f" in <= {GPU_TESTS_S:.0f} s" if name == "gpu" else ""
        ok = t.get("passed")
        if ok and name == "gpu":
            ok = t["seconds"] <= GPU_TESTS_S
        out.append((f"{label} passes on this machine{within}", t["summary"], _holds(ok)))
    return out


ROWS = {
    "precision": _precision_rows,
    "checkpointing": _checkpointing_rows,
    "auto": _auto_rows,
    "framework": _framework_rows,
    "host": _host_rows,
    "speedrun": _speedrun_rows,
    "tests": _tests_rows,
}


def markdown(data: dict) -> str:
    """The record: header, the table, the details, the chart and the raw JSON."""
    from bench import report

    m = data["machine"]
    if m["gpu"]:
        head = f"**{m['gpu']}**, driver {m['driver'] or '?'}, CUDA {m['cuda']}, cuDNN {m['cudnn']}"
    else:
        head = "**not a GPU**: a CPU dry run at tiny sizes (the figures say nothing about a GPU)"
    lines = [
        f"### `make bench-gpu`, {m['date']}\n",
        f"{head}; torch {m['torch']}, Lightning {m['lightning']}, torchmetrics "
        f"{m['torchmetrics']}, torchvision {m['torchvision']}, hydra-core {m['hydra-core']}, "
        f"Python {m['python']}; {m['cpu_cores']} CPU cores; commit {m['commit']}"
        f"{' (with uncommitted changes)' if m['dirty'] else ''}. Took {data['seconds']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in data.get("section_seconds", {}).items())
        + f"). Data: {data['images']}.\n",
    ]
    if data["missing"]:
        lines.append(f"Missing: {', '.join(data['missing'])}.\n")
    lines.append("\n" + report.markdown(["target", "measured", "holds"], rows(data)))
    lines.append("\n" + details(data))
    if data.get("chart"):
        lines.append(f"\n![bench-gpu chart]({data['chart']})\n")
    elif data.get("chart_note"):
        lines.append(f"\nChart: {data['chart_note']}.\n")
    raw = json.dumps(data, indent=1, default=str)
    lines.append(f"\n<details><summary>raw JSON</summary>\n\n```json\n{raw}\n```\n\n</details>\n")
    return "".join(lines)


def details(data: dict) -> str:
    from bench import report

    text = []
    prec = data.get("precision", [])
    if prec:
        text.append(
            "Precision modes (the steps after warm-up timed as one window, the device synchronised "
            "at its ends only). Memory, each timed step in a window of its own (the batch already "
            "fetched): `step` is the step's own "
            "peak, what it adds over what was allocated at its start; `base` that start (the "
            "data kept on the device, weights, gradients, optimizer state); `all` the highest "
            "peak of everything allocated. MB; on CPU `all` is the process's peak RSS:\n\n"
        )
        table = []
        for r in prec:
            lt, pl = r["lightning"], r["plain"]
            keys = ("images_per_sec", "step_ms", "step_peak_mb", "base_mb", "peak_mb")
            table.append(
                [r["mode"], "channels_last" if r["channels_last"] else "NCHW"]
                + [loop.get(k) for k in keys for loop in (lt, pl)]
            )
        cols = ["img/s", "ms", "step MB", "base MB", "all MB"]
        both = [f"{who} {c}" for c in cols for who in ("template", "plain")]
        text.append(report.markdown(["mode", "layout", *both], table))
    ckpt = data.get("checkpointing", [])
    if ckpt:
        text.append("\nActivation checkpointing (16-mixed, template):\n\n")
        keys = ("step_ms", "step_peak_mb", "base_mb", "peak_mb", "skipped")
        table = [[r["setting"], *(r.get(k) for k in keys)] for r in ckpt]
        cols = ["setting", "step ms", "step MB", "base MB", "all MB", "note"]
        text.append(report.markdown(cols, table))
    host = data.get("host", {}).get("profile")
    if host:
        text.append(
            "\nHost work of a step by owner (cProfile, microseconds per step; inflates Python "
            "against torch ops):\n\n"
        )
        by = host["us_per_step_by_owner"]
        lightning = by["lightning"].get("total", by["lightning"])
        owners = list(dict.fromkeys([*lightning, *by["plain"]]))
        table = [[o, by["plain"].get(o), lightning.get(o)] for o in owners]
        text.append(report.markdown(["owner", "plain", "Lightning (recipe)"], table))
    return "".join(text)


def chart(data: dict, path: Path) -> str | None:
    """The chart, or why there is none."""
    if importlib.util.find_spec("matplotlib") is None:
        return "not drawn: matplotlib is not installed"
    from bench import report

    prec = data.get("precision", [])
    labels = [f"{r['mode']} {'CL' if r['channels_last'] else 'NCHW'}" for r in prec]
    panels = [
        (
            "precision modes: images/s",
            {
                loop: [r[loop].get("images_per_sec") for r in prec]
                for loop in ("lightning", "plain")
            },
        ),
        (
            "precision modes: a step's own peak memory (MB)",
            {loop: [r[loop].get("step_peak_mb") for r in prec] for loop in ("lightning", "plain")},
        ),
    ]
    report.grouped_bars(path, labels, panels)
    return None


def write_record(doc: Path, text: str) -> None:
    """Replace the doc's record section (between the markers) with `text`; append the
    section where the markers are missing."""
    old = doc.read_text() if doc.is_file() else ""
    block = f"{START}\n{text}{END}"
    if START in old and END in old:
        new = old[: old.index(START)] + block + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip("\n") + "\n\n## Record (`make bench-gpu`)\n\n" + block + "\n"
    doc.write_text(new)
