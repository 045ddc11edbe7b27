"""Rename the template for a fork: `python scripts/rename.py <your_pkg>` (`make rename NAME=...`).

- the package folder src/cifar_amp and every path part holding its name (the extras' Hydra
  plugin, src/hydra_plugins/cifar_amp_extras);
- every text file's references: module paths in configs (`_target_`, `/schema/<path>` lines),
  code, tests and docs, and the distribution `cifar-amp` (pyproject's `[project] name`, the
  `test` group that installs the others, the README's title);
- the checkpoints under tests/: loaded with torch.load (weights_only: plain data), their
  strings renamed, saved again. A checkpoint is a zip of pickles, which sed cannot edit;
- src/*.egg-info, setuptools' build metadata of the old name, is removed (reinstalling writes it).

Files that git ignores (.venv, data, logs) are left alone; outside a git checkout every file
is renamed but those folders. Needs torch (for the checkpoints): run it with the venv's python.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Outside a git checkout: what git would not hold (the top's venv, data and runs; caches).
SKIP_TOP, SKIP = {".venv", "data", "logs", "outputs", ".bench-site"}, {".git", "__pycache__"}


def skipped(rel: Path) -> bool:
    return rel.parts[0] in SKIP_TOP or bool(SKIP & set(rel.parts))


def files(root: Path) -> list[Path]:
    """The files to rename in: git's tracked and untracked-but-not-ignored ones, else all."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout.decode()
        return [
            root / p for p in sorted(set(filter(None, out.split("\0")))) if (root / p).is_file()
        ]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (a copy)
        return [
            p for p in sorted(root.rglob("*")) if p.is_file() and not skipped(p.relative_to(root))
        ]


def renamed(value, old: str, new: str):
    """`value` with `old` replaced by `new` in every string and dict key inside it."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {renamed(k, old, new): renamed(v, old, new) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(renamed(v, old, new) for v in value)
    return value


def rename_checkpoint(path: Path, old: str, new: str) -> None:
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    torch.save(renamed(ckpt, old, new), path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the new package name (a Python identifier)")
    parser.add_argument("--root", type=Path, default=REPO, help="the repository to rename in")
    args = parser.parse_args(argv)
    root, new = args.root.resolve(), args.name
    try:  # before anything is renamed: the checkpoints need it
        import torch  # noqa: F401
    except ImportError:
        parser.error("needs torch, for the checkpoints: run it with the venv's python")
    if not new.isidentifier() or new != new.lower():
        parser.error(f"{new}: a package name is a lower-case Python identifier (my_project)")
    # pyproject.toml's first `name =` is [project]'s (tomllib is Python 3.11+).
    old_dist = re.search(r'^name = "([^"]+)"', (root / "pyproject.toml").read_text(), re.M)[1]
    new_dist = new.replace("_", "-")
    pkgs = [p.parent.name for p in (root / "src").glob("*/__init__.py")]
    if len(pkgs) != 1:
        parser.error(f"expected one package in {root / 'src'}, found {pkgs}")
    old = pkgs[0]
    if old == new:
        parser.error(f"the package is already called {new}")
    # The distribution where it stands as a name (not inside a longer word or path).
    dist = re.compile(rf"(?<![\w/-]){re.escape(old_dist)}(?![\w-])")
    done = 0
    for path in files(root):
        if path.suffix == ".ckpt":
            rename_checkpoint(path, old, new)
            done += 1
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a binary file: nothing of ours is named inside
            continue
        changed = dist.sub(new_dist, text.replace(old, new))
        if changed != text:
            path.write_text(changed)
            done += 1
    # setuptools' build metadata of the old name (an editable install's): the next install
    # writes it anew, and renamed it would list the old package.
    for stale in root.glob("src/*.egg-info"):
        shutil.rmtree(stale)
    # Folders last, deepest first: src/<pkg>, src/hydra_plugins/<pkg>_extras.
    for path in sorted(root.rglob(f"*{old}*"), key=lambda p: -len(p.parts)):
        if not skipped(path.relative_to(root)):
            path.rename(path.with_name(path.name.replace(old, new)))
    print(
        f"renamed {old} to {new} and {old_dist} to {new_dist} in {done} files; "
        f"reinstall: pip install -e '.[test]' (make test does)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
