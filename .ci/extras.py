"""Proof that every extra is a leaf. An extra is a folder, `src/<pkg>/extras/<name>/` (its
code and configs) with its tests in `tests/extras/<name>/`; its `__init__.py` says what it adds
(the docstring), which extras it uses (`NEEDS`) and any file of it outside those folders
(`OUTSIDE`). `bench/` is the one extra at the top (its tests: bench/tests/). Two kinds of copy
of the repository (its tracked files, minus the deleted ones):

- the core alone (every extra deleted) passes every remaining default test, i.e. the core's;
- the core and one extra (with the extras it needs, nothing else) passes that extra's tests.

Each copy also trains the default recipe for one epoch (tests/test_default_recipe.py, in the
core's tests and beside each extra's). With `make test` (everything present) this covers deleting
any one extra or all of them: the core passes without any extra, and every other extra passes
with none of the others. It costs one run of the tests, not one per extra; the copies run side by
side, one per core.

    python .ci/extras.py [name ...]      # default: the core alone, then each extra alone
    python .ci/extras.py --docs          # rewrite docs/fork.md's table of extras from the tree

A copy runs on this venv with PYTHONPATH=<copy>/src, so its own package is imported, not the
checkout's.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXTRAS = next((REPO / "src").glob("*/extras"))  # src/<pkg>/extras, whatever <pkg> is called
DOCS = REPO / "docs" / "fork.md"
DEFAULT_RECIPE = "tests/test_default_recipe.py"  # a copy with an extra trains it too
TABLE = re.compile(r"(<!-- extras: .*? -->\n).*?(<!-- end of extras -->)", re.S)


def _declared(init: Path) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(docstring, NEEDS, OUTSIDE) of an extra's __init__.py, read without importing it."""
    tree = ast.parse(init.read_text())
    values = {
        t.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name) and t.id in ("NEEDS", "OUTSIDE")
    }
    return ast.get_docstring(tree) or "", values.get("NEEDS", ()), values.get("OUTSIDE", ())


def extras() -> dict[str, tuple[list[str], list[str], str]]:
    """name -> (its paths, names of the extras it needs, what it adds), from the tree."""
    found = {}
    for init in sorted(EXTRAS.glob("*/__init__.py")) + [REPO / "bench" / "__init__.py"]:
        if not init.is_file():
            continue
        name, folder = init.parent.name, init.parent.relative_to(REPO).as_posix()
        doc, needs, outside = _declared(init)
        tests = REPO / "tests" / "extras" / name
        paths = [
            folder,
            *([tests.relative_to(REPO).as_posix()] if tests.is_dir() else []),
            *outside,
        ]
        found[name] = (paths, list(needs), " ".join(doc.split()))
    unknown = {
        n: sorted(set(e[1]) - set(found)) for n, e in found.items() if set(e[1]) - set(found)
    }
    if unknown:
        sys.exit(f"extras that need extras that are not here: {unknown}")
    return found


def needed(name: str, table: dict) -> set[str]:
    """The extra and every extra it needs, transitively (they come with it)."""
    out, todo = set(), [name]
    while todo:
        if (n := todo.pop()) not in out:
            out.add(n)
            todo += table[n][1]
    return out


def docs(table: dict) -> str:
    """docs/fork.md's table, written from the tree."""
    rows = ["| extra | what it adds | needs | delete these to drop it |", "|---|---|---|---|"]
    for name, (paths, needs, what) in table.items():
        what = re.sub(rf"^The {name} extra: ", "", what).replace("|", "\\|")
        need = " ".join(f"**{n}**" for n in needs)
        rows.append(f"| **{name}** | {what} | {need} | {' '.join(f'`{p}`' for p in paths)} |")
    return "\n".join(rows) + "\n"


def copy_without(paths: list[str], dest: Path) -> None:
    tracked = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    gone = [p.rstrip("/") for p in paths]
    for rel in filter(None, tracked):
        if any(rel == g or rel.startswith(g + "/") for g in gone) or not (REPO / rel).exists():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    missing = [g for g in gone if not (REPO / g).exists()]
    if missing:
        sys.exit(f"extras name paths that do not exist: {', '.join(missing)}")


def check(label: str, paths: list[str], tests: list[str]) -> tuple[bool, str]:
    """`tests`: the test files and folders to run in the copy (none: the whole default run),
    in one process: a copy's few tests pay less for one import of torch and Lightning than for
    xdist's three (its controller's and two workers'), and `main` runs copies side by side."""
    with tempfile.TemporaryDirectory(prefix="extras-") as tmp:
        copy = Path(tmp) / "repo"
        copy_without(paths, copy)
        start = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider"]
            + [*tests, *([DEFAULT_RECIPE] if tests else [])],
            cwd=copy,
            env={**os.environ, "PYTHONPATH": str(copy / "src")},
            capture_output=True,
            text=True,
        )
    summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    out = f"{'ok  ' if run.returncode == 0 else 'FAIL'} {label}: {summary} ({time.perf_counter() - start:.0f} s)"
    if run.returncode:
        out += "\n" + (run.stdout + run.stderr)[-4000:]
    return run.returncode == 0, out


def main(argv: list[str]) -> int:
    table = extras()
    text = DOCS.read_text()
    if not TABLE.search(text):
        sys.exit(f"no '<!-- extras: ... -->' block in {DOCS}")
    written = TABLE.sub(lambda m: m[1] + docs(table) + m[2], text)
    if argv == ["--docs"]:
        DOCS.write_text(written)
        return 0
    if not argv and written != text:  # CI's run: the table must say what the folders say
        sys.exit(
            f"{DOCS.relative_to(REPO)}'s table of extras is stale: python .ci/extras.py --docs"
        )
    argv = [n.replace("-", "_") for n in argv]
    unknown = [n for n in argv if n not in table]
    if unknown:
        print(
            f"error: not an extra: {', '.join(unknown)}; extras: {', '.join(table)}",
            file=sys.stderr,
        )
        return 2
    every = [p for paths, _, _ in table.values() for p in paths]
    checks = [] if argv else [("the core alone (no extras)", every, [])]
    for name in argv or table:
        kept = needed(name, table)
        label = " + ".join(["the core", name, *sorted(kept - {name})])
        gone = [p for n, (paths, _, _) in table.items() if n not in kept for p in paths]
        tests = [p for p in table[name][0] if p.startswith("tests/") or p == "bench"]
        tests = [f"{p}/tests" if p == "bench" else p for p in tests]
        if not tests:
            sys.exit(f"the extra {name} has no tests of its own (tests/extras/{name}/)")
        checks.append((label, gone, tests))
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # the core's (the longest) first
        results = []
        for ok, out in pool.map(lambda c: check(*c), checks):
            print(out, flush=True)
            results.append(ok)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
