"""seams.py names, per hook, the extras that implement it: the lists match the classes in
src/cifar_amp/extras/ (read with ast, nothing imported), so they cannot go stale."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from cifar_amp import seams

EXTRAS = Path(seams.__file__).parent / "extras"
LISTED = re.compile(r"extras/(\w+) \(([\w, ]+)\)")


def test_each_hook_lists_the_extras_that_implement_it():
    hooks = [
        n for n, c in vars(seams).items() if inspect.isclass(c) and c.__module__ == seams.__name__
    ]
    found = {hook: set() for hook in hooks}
    for path in EXTRAS.glob("*/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    hook = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                    if hook in found:
                        found[hook].add((path.relative_to(EXTRAS).parts[0], node.name))
    for hook in hooks:
        listed = {
            (extra, cls.strip())
            for extra, classes in LISTED.findall(getattr(seams, hook).__doc__)
            for cls in classes.split(",")
            if (EXTRAS / extra).is_dir()  # an extra a fork deleted leaves a harmless name
        }
        assert listed == found[hook], hook
