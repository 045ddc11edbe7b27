"""Every private name of another package (Lightning, torch, Hydra, omegaconf, ...) that the project
uses is in a compat module (src/cifar_amp/compat.py, or an extra's own compat.py), each with the
reason and the test that fails when a release changes it; the docs' table is made from them."""

from __future__ import annotations

import abc
import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
import runpy
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO

ROOTS = ("src", "bench", "tests", "scripts", ".ci")
COMPATS = sorted(p for root in ("src", "bench", "tests") for p in (REPO / root).rglob("compat.py"))
ENTRIES = [REPO / name for name in ("train.py", "eval.py", "predict.py")]
FILES = sorted(p for root in ROOTS for p in (REPO / root).rglob("*.py") if p not in COMPATS) + [
    p
    for p in ENTRIES
    if p.is_file()  # predict.py goes with the predict extra
]
OUR_ROOTS = {"cifar_amp", "bench", "hydra_plugins"} | {
    p.stem for p in (REPO / "tests").rglob("*.py")
}  # test modules import each other by name (pytest's pythonpath)
HYDRA_KEYS = {"_target_", "_recursive_", "_convert_", "_partial_", "_args_"}  # public config keys
PRIVATE = re.compile(r"_[A-Za-z]\w*")
ENTRY = re.compile(r"^# (?P<names>.+?): (?P<why>.+?) Fails: (?P<test>\S+::\w+)$")


def private(name: str) -> bool:
    return bool(PRIVATE.fullmatch(name)) and not name.startswith("__") and name not in HYDRA_KEYS


def another_package(module: str) -> bool:
    root = module.split(".")[0]
    return root not in OUR_ROOTS and root not in sys.stdlib_module_names and root != "__future__"


def our_attributes(more: tuple[Path, ...] = ()) -> set[str]:
    """The private attribute and method names that the project's own classes define (in its
    files and `more`), and its modules' own private names."""
    names = set()
    for path in [*FILES, *COMPATS, *more]:
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else []
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    targets = item.targets if isinstance(item, ast.Assign) else []
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
            self_store = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if self_store and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return names


def uses(path: Path, ours: set[str]) -> list[str]:
    """Where `path` names a private name of another package: `line: what`."""
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # a local name -> the module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
                if another_package(a.name) and any(map(private, a.name.split("."))):
                    found.append(f"{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                modules[a.asname or a.name] = f"{node.module}.{a.name}"
                named = [*node.module.split("."), a.name]
                if another_package(node.module) and any(map(private, named)):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
    # Strings that are parts of f-strings, or name an attribute of a module of ours or of the
    # standard library (monkeypatch.setattr(urllib.request, "_opener", ...)).
    exempt = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            root = node.args[0]
            while isinstance(root, ast.Attribute):
                root = root.value
            module = modules.get(root.id) if isinstance(root, ast.Name) else None
            if module and not another_package(module):
                exempt |= {id(a) for a in node.args[1:]}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            module = modules.get(root.id) if isinstance(root, ast.Name) else None
            if module and not another_package(module):
                continue  # a module of ours
            if module or node.attr not in ours:
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in exempt and private(node.value) and node.value not in ours:
                found.append(f"{node.lineno}: '{node.value}'")
    return found


def test_no_file_outside_the_compat_modules_names_another_packages_private_name():
    ours = our_attributes()
    found = {str(p.relative_to(REPO)): uses(p, ours) for p in FILES}
    assert {path: lines for path, lines in found.items() if lines} == {}


def library_private_names(cls: type) -> set[str]:
    """The private names `cls` (another package's class) has: attributes, and those its methods
    set on instances."""
    names = {n for n in dir(cls) if private(n)}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # a class without Python source
        return names
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "self" and private(node.attr):
                names.add(node.attr)
    return names


def our_classes():
    for package in ("cifar_amp", "bench"):
        if importlib.util.find_spec(package) is None:  # bench/ deleted, as a fork may
            continue
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith((".compat", "__main__")):
                continue
            module = importlib.import_module(info.name)
            for cls in vars(module).values():
                if inspect.isclass(cls) and cls.__module__ == module.__name__:
                    yield cls


def test_no_class_of_ours_outside_the_compat_modules_touches_a_base_classs_private_name():
    """A subclass of another package's class that reads, sets or overrides one of its private
    names (`self._x`) would break silently when a release renames it."""
    found = {}
    for cls in our_classes():
        theirs, standard = set(), set(dir(abc.ABC))  # ABCMeta's names, on every ABC
        for base in cls.__mro__[1:]:
            if another_package(base.__module__):
                theirs |= library_private_names(base)
            else:
                standard |= set(dir(base))
        theirs -= standard
        if not theirs:
            continue
        mine = {n for n in vars(cls) if private(n)}
        functions = [f for f in vars(cls).values() if inspect.isfunction(f)]
        for function in functions:
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                    if node.value.id in ("self", "cls") and private(node.attr):
                        mine.add(node.attr)
        if touched := sorted(mine & theirs):
            found[f"{cls.__module__}.{cls.__qualname__}"] = touched
    assert found == {}


def entries(path: Path) -> list[dict]:
    """The compat module's entries: (names, why, test), one `# names: why. Fails: test` line each
    before a top-level definition."""
    lines = path.read_text().splitlines()
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            continue  # a helper of the entries
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)):
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            comment = lines[first - 2] if first >= 2 else ""
            out.append({"line": first, "match": ENTRY.match(comment), "comment": comment})
    return out


@pytest.mark.parametrize("path", COMPATS, ids=lambda p: str(p.relative_to(REPO)))
def test_each_compat_entry_says_why_and_which_test_fails(path):
    for entry in entries(path):
        assert entry["match"], f"{path.name}:{entry['line']}: {entry['comment']!r}"
        test_file, _, test = entry["match"]["test"].partition("::")
        assert (REPO / test_file).is_file(), entry["match"]["test"]
        defined = re.search(rf"^def {test}\b", (REPO / test_file).read_text(), re.M)
        assert defined, f"{path.name}:{entry['line']}: no {entry['match']['test']}"


def test_the_scan_finds_each_way_of_naming_a_private_name(tmp_path):
    path = tmp_path / "example.py"
    path.write_text(
        textwrap.dedent(
            """\
            import torch
            import urllib.request
            from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
            from torch._inductor import config
            norm = torch._foreach_norm
            trainer._signal_connector.received_sigterm = True
            scale = getattr(scaler, "_scale")
            monkeypatch.setattr(urllib.request, "_opener", None)
            self._mine = 1
            """
        )
    )
    assert uses(path, our_attributes(more=(path,))) == [
        "3: from lightning.fabric.utilities.cloud_io import _is_local_file_protocol",
        "4: from torch._inductor import config",
        "5: ._foreach_norm",
        "6: ._signal_connector",
        "7: '_scale'",
    ]


def test_the_docs_table_is_written_from_the_compat_modules():
    """The table in docs/reliability.md is the compat modules' (the rows of an extra a fork
    deleted, and its compat.py with it, may stay)."""
    script = runpy.run_path(str(REPO / "scripts" / "compat_table.py"))
    text = script["DOC"].read_text()
    table = text[text.index(script["BEGIN"]) : text.index(script["END"])]
    here = [row for row in table.splitlines() if row.startswith("| `")]
    here = [row for row in here if (REPO / row.split("`")[3]).is_file()]
    assert here == script["rows"](), "stale: python scripts/compat_table.py"
    assert len(here) == sum(len(entries(p)) for p in COMPATS)
