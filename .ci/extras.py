"""Proof that every extra is a leaf. An extra is a folder, `src/<pkg>/extras/<name>/` (its
code and configs) with its tests in `tests/extras/<name>/`; its `__init__.py` says what it adds
(the docstring), which extras it uses (`NEEDS`), any file of it outside those folders
(`OUTSIDE`) and, for an extra the default run uses, what that run loses without it
(`DEFAULT_RUN_LOSES`). `bench/` is the one extra at the top (its tests: bench/tests/). Three
kinds of copy of the repository (its tracked files, minus the deleted ones):

- the core alone (every extra deleted) passes every remaining default test, i.e. the core's;
- the core and one extra (with the extras it needs, nothing else) passes that extra's tests,
  and trains the default recipe for one epoch (tests/test_default_recipe.py);
- every extra but one: the default recipe, shrunk to one epoch of a tiny folder, trains with
  `python train.py` and `python eval.py` tests its checkpoint (both in one process), or
  train.py stops at once with one line (exit 2) naming the extras that need the deleted one.
  Only for an extra that the default run uses or another extra needs: for any other, the
  default run never reaches its code (the second kind proves that each extra the default run
  uses works without it), so its copy would train and test exactly as the whole tree does.

The copies run side by side, one per core.

    python .ci/extras.py [name ...]      # default: all three kinds; names: the last two for those
    python .ci/extras.py --deleted [name ...]   # only the third kind (default: every extra)
    python .ci/extras.py --docs          # rewrite the tables in docs/fork.md and the README

Without `--docs`, a run with no names refuses docs that differ from the tree: the table of
extras, and the list of those the default run uses (read from its composed config).

A copy runs on this venv with PYTHONPATH=<copy>/src, so its own package is imported, not the
checkout's.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
EXTRAS = next((REPO / "src").glob("*/extras"))  # src/<pkg>/extras, whatever <pkg> is called
DOCS = REPO / "docs" / "fork.md"
README = REPO / "README.md"
DEFAULT_RECIPE = "tests/test_default_recipe.py"  # a copy with an extra trains it too
TABLE = re.compile(r"(<!-- extras: .*? -->\n).*?(<!-- end of extras -->)", re.S)
IN_DEFAULT_RUN = re.compile(r"(<!-- default run: .*? -->\n).*?(<!-- end of default run -->)", re.S)


class Extra(NamedTuple):
    paths: list[str]  # what deleting it deletes
    needs: list[str]  # the extras it uses
    adds: str  # its docstring, on one line
    default_run_loses: str  # what `python train.py` loses without it; "" if it does not use it


def _declared(init: Path) -> dict:
    """An extra's __init__.py: its docstring and constants, read without importing it."""
    tree = ast.parse(init.read_text())
    values = {
        t.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name) and t.id in ("NEEDS", "OUTSIDE", "DEFAULT_RUN_LOSES")
    }
    return {"doc": ast.get_docstring(tree) or ""} | values


def extras() -> dict[str, Extra]:
    """name -> what the tree says of it."""
    found = {}
    for init in sorted(EXTRAS.glob("*/__init__.py")) + [REPO / "bench" / "__init__.py"]:
        if not init.is_file():
            continue
        name, folder = init.parent.name, init.parent.relative_to(REPO).as_posix()
        said = _declared(init)
        tests = REPO / "tests" / "extras" / name
        paths = [
            folder,
            *([tests.relative_to(REPO).as_posix()] if tests.is_dir() else []),
            *said.get("OUTSIDE", ()),
        ]
        loses = " ".join(said.get("DEFAULT_RUN_LOSES", "").split())
        found[name] = Extra(
            paths, list(said.get("NEEDS", ())), " ".join(said["doc"].split()), loses
        )
    unknown = {n: sorted(set(e.needs) - set(found)) for n, e in found.items()}
    if unknown := {n: u for n, u in unknown.items() if u}:
        sys.exit(f"extras that need extras that are not here: {unknown}")
    return found


def used_by_default_run() -> set[str]:
    """The extras whose classes the default run's composed config names (`_target_`), Hydra's
    own callbacks included: those that an `optional` default turns on."""
    sys.path.insert(0, str(REPO / "src"))
    package = EXTRAS.parent.name
    config = importlib.import_module(f"{package}.config")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    config.register(REPO / "configs")
    with initialize_config_dir(str(REPO / "configs"), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    targets, todo = [], [OmegaConf.to_container(cfg, resolve=False)]
    while todo:
        node = todo.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if key == "_target_" and isinstance(value, str):
                targets.append(value)
            elif isinstance(value, (dict, list)):
                todo.append(value)
    prefix = f"{package}.extras."
    return {t.removeprefix(prefix).split(".")[0] for t in targets if t.startswith(prefix)}


def check_default_run(table: dict[str, Extra]) -> None:
    """Each extra the default run uses says what the run loses without it, and no other does."""
    used = used_by_default_run()
    if silent := sorted(n for n in used if not table[n].default_run_loses):
        sys.exit(
            f"the default run uses {', '.join(silent)}: say in each one's __init__.py what "
            "it loses without it (DEFAULT_RUN_LOSES)"
        )
    if stale := sorted(n for n, e in table.items() if e.default_run_loses and n not in used):
        sys.exit(f"{', '.join(stale)}: DEFAULT_RUN_LOSES, but the default run does not use it")


def needed(name: str, table: dict[str, Extra]) -> set[str]:
    """The extra and every extra it needs, transitively (they come with it)."""
    out, todo = set(), [name]
    while todo:
        if (n := todo.pop()) not in out:
            out.add(n)
            todo += table[n].needs
    return out


def docs(table: dict[str, Extra]) -> str:
    """docs/fork.md's table, written from the tree."""
    rows = [
        "| extra | what it adds | needs | on in the default run: a run without it loses "
        "| delete these to drop it |",
        "|---|---|---|---|---|",
    ]
    for name, e in table.items():
        what = re.sub(rf"^The {name} extra: ", "", e.adds).replace("|", "\\|")
        need = " ".join(f"**{n}**" for n in e.needs)
        paths = " ".join(f"`{p}`" for p in e.paths)
        rows.append(f"| **{name}** | {what} | {need} | {e.default_run_loses} | {paths} |")
    return "\n".join(rows) + "\n"


def default_run_docs(table: dict[str, Extra]) -> str:
    """The README's list of the extras the default run uses, written from the tree."""
    used = [(n, e) for n, e in table.items() if e.default_run_loses]
    return (
        f"The default run uses {len(used)} extras, each turned on by an `optional` default in "
        "`configs/`; delete one and the run goes on without it, losing what it adds:\n\n"
        + "".join(f"- **{n}**: a run without it loses {e.default_run_loses}.\n" for n, e in used)
    )


def written(table: dict[str, Extra]) -> dict[Path, tuple[str, str]]:
    """file -> (its text, its text with the tables written from the tree)."""
    out = {}
    for path, block, text in (
        (DOCS, TABLE, docs(table)),
        (README, IN_DEFAULT_RUN, default_run_docs(table)),
    ):
        old = path.read_text()
        if not block.search(old):
            sys.exit(f"no '<!-- ... -->' block for {block.pattern[3:20]}... in {path}")
        out[path] = (old, block.sub(lambda m, t=text: m[1] + t + m[2], old))
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
        sys.exit(f"extras name paths that do not exist: {', '.join(missing)}")


def _result(label: str, ok: bool, summary: str, start: float, log: str = "") -> tuple[bool, str]:
    out = f"{'ok  ' if ok else 'FAIL'} {label}: {summary} ({time.perf_counter() - start:.0f} s)"
    return ok, out + ("" if ok else "\n" + log[-4000:])


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
    return _result(label, run.returncode == 0, summary, start, run.stdout + run.stderr)


# Runs the commands given (JSON: [[script, [args]], ...]) one after the other in one process, as
# `python <script> <args>` runs each but for the interpreter's start (torch and Lightning
# imported once), until one exits non-zero; prints each one's exit status and stderr as JSON.
COMMANDS = """
import contextlib, io, json, runpy, sys
from hydra.core.global_hydra import GlobalHydra
done = []
for script, args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    GlobalHydra.instance().clear()
    done.append({"exit": code, "stderr": err.getvalue()})
    if code:
        break
print("\\n" + json.dumps(done))
"""


def check_deleted(name: str, table: dict[str, Extra], data: Path) -> tuple[bool, str]:
    """A copy without `name` alone: train.py trains the default recipe (one epoch of the tiny
    folder `data`) and eval.py tests its last checkpoint, or train.py stops at once with one
    line, exit 2, naming every extra of the package that needs `name`. Both commands run in
    one process (COMMANDS)."""
    users = [n for n, e in table.items() if name in e.needs and e.paths[0].startswith("src/")]
    label = f"every extra but {name}"
    with tempfile.TemporaryDirectory(prefix="extras-") as tmp:
        copy, runs = Path(tmp) / "repo", Path(tmp) / "runs"
        copy_without(table[name].paths, copy)
        start = time.perf_counter()
        data_args = [f"data.data_dir={data}", "data.download=false"]
        commands = [
            ("train.py", [*data_args, "trainer.max_epochs=1"]),
            ("eval.py", [*data_args, f"ckpt_path={runs / 'train' / 'checkpoints' / 'last.ckpt'}"]),
        ]
        commands = [
            (cmd, [*args, "trainer.enable_progress_bar=false", f"hydra.run.dir={runs / cmd[:-3]}"])
            for cmd, args in commands
        ]
        run = subprocess.run(
            [sys.executable, "-c", COMMANDS, json.dumps(commands)],
            cwd=copy,
            env={**os.environ, "PYTHONPATH": str(copy / "src")},
            capture_output=True,
            text=True,
        )
        log = f"$ python train.py ... && python eval.py ...\n{run.stdout}{run.stderr}"
        try:
            done = json.loads(run.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return _result(label, False, "the commands did not run", start, log)
        said = done[0]["stderr"].strip().splitlines()
        if done[0]["exit"] == 2 and len(said) == 1 and users:
            named = said[0].startswith("error: ") and all(u in said[0] for u in users)
            return _result(label, named, f"train.py refused it in one line: {said[0]}", start, log)
        for (cmd, _), result in zip(commands, done, strict=False):
            if result["exit"] or not (runs / cmd[:-3] / "metrics.json").is_file():
                return _result(label, False, f"{cmd} failed", start, log)
        if len(done) < len(commands):
            return _result(label, False, "eval.py did not run", start, log)
    return _result(label, True, "train.py trained the default recipe, eval.py tested it", start)


def tiny_data(root: Path) -> Path:
    """A tiny CIFAR-10 folder, written by the tests' own helper (nothing is downloaded)."""
    sys.path.insert(0, str(REPO / "tests"))
    return importlib.import_module("cifar_folder").write_cifar_folder(root)


def main(argv: list[str]) -> int:
    table = extras()
    if argv == ["--docs"]:
        check_default_run(table)
        for path, (_, new) in written(table).items():
            path.write_text(new)
        return 0
    deleted_only = argv[:1] == ["--deleted"]
    names = [n.replace("-", "_") for n in argv[deleted_only:]]
    if not argv:  # CI's run: the docs must say what the folders and the default run say
        check_default_run(table)
        if stale := [p.relative_to(REPO) for p, (old, new) in written(table).items() if old != new]:
            sys.exit(
                f"{', '.join(map(str, stale))}: the extras' tables are stale: "
                "python .ci/extras.py --docs"
            )
    if unknown := [n for n in names if n not in table]:
        print(
            f"error: not an extra: {', '.join(unknown)}; extras: {', '.join(table)}",
            file=sys.stderr,
        )
        return 2
    every = [p for e in table.values() for p in e.paths]
    checks = [] if names or deleted_only else [(check, "the core alone (no extras)", every, [])]
    for name in [] if deleted_only else names or table:
        kept = needed(name, table)
        label = " + ".join(["the core", name, *sorted(kept - {name})])
        gone = [p for n, e in table.items() if n not in kept for p in e.paths]
        tests = [p for p in table[name].paths if p.startswith("tests/") or p == "bench"]
        tests = [f"{p}/tests" if p == "bench" else p for p in tests]
        if not tests:
            sys.exit(f"the extra {name} has no tests of its own (tests/extras/{name}/)")
        checks.append((check, label, gone, tests))
    reached = used_by_default_run() | {n for e in table.values() for n in e.needs}
    implied = [n for n in names or table if n not in reached and not deleted_only]
    for name in implied:
        print(
            f"ok   every extra but {name}: implied (the default run uses it not, no extra needs it)"
        )
    with tempfile.TemporaryDirectory(prefix="extras-data-") as tmp:
        data = tiny_data(Path(tmp))
        checks += [(check_deleted, n, table, data) for n in names or table if n not in implied]
        with ThreadPoolExecutor(os.cpu_count()) as pool:  # the core's (the longest) first
            results = []
            for ok, out in pool.map(lambda c: c[0](*c[1:]), checks):
                print(out, flush=True)
                results.append(ok)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
