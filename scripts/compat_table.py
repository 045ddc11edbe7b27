"""The docs' table of the private names of other packages that the project uses, made from the
compat modules' entry lines (`# <names>: <why>. Fails: <test>`):

    python scripts/compat_table.py            # rewrite the table in docs/reliability.md
    python scripts/compat_table.py --check    # exit 1 if the table there is stale (the tests do)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
BEGIN = "<!-- compat: written by `python scripts/compat_table.py` from the compat modules -->"
END = "<!-- end of compat -->"
ENTRY = re.compile(r"^# (?P<names>.+?): (?P<why>.+?) Fails: (?P<test>\S+::\w+)$")
DEFINED = re.compile(r"^(?:def |class )?(?P<name>\w+)")


def compat_modules() -> list[Path]:
    return sorted(p for root in ("src", "bench", "tests") for p in (REPO / root).rglob("compat.py"))


def rows() -> list[str]:
    out = []
    for path in compat_modules():
        lines = path.read_text().splitlines()
        for comment, definition in zip(lines, lines[1:], strict=False):
            entry = ENTRY.match(comment)
            if entry:
                name = DEFINED.match(definition)["name"]
                where = f"`{path.relative_to(REPO)}`: `{name}`"
                test = entry["test"]
                out.append(f"| `{entry['names']}` | {where} | {entry['why']} | `{test}` |")
    return out


def table() -> str:
    head = ["| private name | through | why no public API serves | the test that fails |"]
    return "\n".join([BEGIN, *head, "|---|---|---|---|", *rows(), END])


def written(text: str) -> str:
    """`text` (the doc) with its table replaced by today's."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + table() + text[end:]


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    if argv == ["--check"]:
        if written(text) != text:
            print(f"{DOC}: the compat table is stale: python scripts/compat_table.py")
            return 1
        return 0
    DOC.write_text(written(text))
    print(f"wrote the compat table of {DOC} ({len(rows())} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
