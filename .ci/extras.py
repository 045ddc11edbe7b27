"""Proof that every extra is a leaf, from docs/fork.md's table. Two kinds of copy of the
repository (its tracked files, minus the deleted ones):

- the core alone (every extra deleted) passes every remaining default test, i.e. the core's;
- the core and one extra (with the extras it needs, nothing else) passes that extra's tests.

Each copy also trains the default recipe for one epoch. With `make test` (everything present)
this covers deleting any one extra or all of them: the core passes without any extra, and every
other extra passes with none of the others. It costs one run of the tests, not one per extra
(the "without X" copy per extra ran the other extras' tests 16 times, 77 minutes of CI).

    python .ci/extras.py [name ...]      # default: the core alone, then each extra alone

A copy runs on this venv with PYTHONPATH=<copy>/src, so its own package is imported, not the
checkout's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs" / "fork.md"
ROW = re.compile(
    r"^\| \*\*(?P<name>[\w-]+)\*\* \|(?P<what>[^|]*)\|(?P<needs>[^|]*)\|(?P<files>[^|]*)\|$"
)


def extras() -> dict[str, tuple[list[str], list[str]]]:
    """name -> (paths, names of the extras it needs), from the table in docs/fork.md."""
    found = {}
    for line in TABLE.read_text().splitlines():
        if m := ROW.match(line.strip()):
            paths = re.findall(r"`([^`]+)`", m["files"])
            needs = re.findall(r"\*\*([\w-]+)\*\*", m["needs"])
            found[m["name"]] = (paths, needs)
    if not found:
        sys.exit(f"no extras table in {TABLE}")
    return found


def needed(name: str, table: dict) -> set[str]:
    """The extra and every extra it needs, transitively (they come with it)."""
    out, todo = set(), [name]
    while todo:
        if (n := todo.pop()) not in out:
            out.add(n)
            todo += table[n][1]
    return out


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
        sys.exit(f"docs/fork.md names paths that do not exist: {', '.join(missing)}")


def check(label: str, paths: list[str], tests: list[str]) -> bool:
    """`tests`: the test files and folders to run in the copy (none: the whole default run)."""
    with tempfile.TemporaryDirectory(prefix="extras-") as tmp:
        copy = Path(tmp) / "repo"
        copy_without(paths, copy)
        env = {**os.environ, "PYTHONPATH": str(copy / "src")}
        start = time.perf_counter()
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        data = Path(tmp) / "data"
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"from cifar_folder import write_cifar_folder as w; w(__import__('pathlib').Path('{data}'))",
            ],
            cwd=copy / "tests",
            env=env,
            check=True,
        )
        fit = subprocess.run(
            [
                sys.executable,
                "train.py",
                "trainer.max_epochs=1",
                f"data.data_dir={data}",
                "data.download=false",
            ]
            + [f"hydra.run.dir={tmp}/run", "trainer.enable_progress_bar=false"],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        ok = (
            tests.returncode == 0
            and fit.returncode == 0
            and (Path(tmp) / "run" / "metrics.json").is_file()
        )
        summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(
            f"{'ok  ' if ok else 'FAIL'} {label}: tests: {summary}; default recipe, 1 epoch: "
            f"exit {fit.returncode} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        if not ok:
            print((tests.stdout + tests.stderr)[-4000:], fit.stderr[-2000:], sep="\n", flush=True)
        return ok


def _is_test(path: str) -> bool:
    """A test file, or a folder of tests (bench/ holds bench/tests/)."""
    name = Path(path).name
    return (name.startswith("test_") and name.endswith(".py")) or (REPO / path / "tests").is_dir()


def main(argv: list[str]) -> int:
    table = extras()
    unknown = [n for n in argv if n not in table]
    if unknown:
        print(
            f"error: not an extra: {', '.join(unknown)}; extras: {', '.join(table)}",
            file=sys.stderr,
        )
        return 2
    every = [p for paths, _ in table.values() for p in paths]
    results = [] if argv else [check("the core alone (no extras)", every, [])]
    for name in argv or table:
        kept = needed(name, table)
        label = " + ".join(["the core", name, *sorted(kept - {name})])
        gone = [p for n, (paths, _) in table.items() if n not in kept for p in paths]
        tests = [p for p in table[name][0] if _is_test(p)]
        if not tests:
            sys.exit(f"docs/fork.md: the extra {name} names no tests of its own")
        results.append(check(label, gone, tests))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
