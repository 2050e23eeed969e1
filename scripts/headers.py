#!/usr/bin/env python3
"""Patch headers and the README's series table.

    python scripts/headers.py check     # every patch has every header field
    python scripts/headers.py table     # rewrite the README's series table
    python scripts/headers.py table --check

Every patch's commit message is one template: the subject, then the fields
``Why:``, ``How:`` (paragraphs), ``Upstream-Status:``, ``Related:`` and
``Remove-When:``. A field runs until the next of these names at the start of
a line, so prose lines such as ``H-leaf: ...`` stay inside their paragraph.
The README's table (Order | Patch | Concern | Upstream-Status | Remove-When)
is generated from the headers between two markers and kept current by a test.
"""

from __future__ import annotations

import argparse
import re

from common import PATCHES, ROOT, ToolError, read_series, run_main

FIELDS = ("Why", "How", "Upstream-Status", "Related", "Remove-When")
README = ROOT / "docs" / "series.md"
START, END = "<!-- series-table -->", "<!-- /series-table -->"
_FIELD = re.compile(r"(?m)^(%s):[ \t]*" % "|".join(re.escape(f) for f in FIELDS))


_SUBJECT = re.compile(r"(?m)^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n[ \t].*)*)")
# The fields that describe the series, not the change (``make pr`` drops them).
SERIES_FIELDS = ("Upstream-Status", "Related", "Remove-When")


def patch_subject(text: str) -> str:
    """The commit subject a format-patch file carries (unfolded, no [PATCH])."""
    m = _SUBJECT.search(text)
    return re.sub(r"\s+", " ", m.group(1)).strip() if m else ""


def patch_header(text: str) -> dict:
    """``{"Subject": ..., field: text}`` of a format-patch file's message."""
    head = text.partition("\ndiff --git ")[0]
    m = _SUBJECT.search(head)
    out = {"Subject": patch_subject(head)}
    body = head[m.end() :] if m else head
    body = body.split("\n---\n", 1)[0]
    marks = list(_FIELD.finditer(body))
    for mark, nxt in zip(marks, marks[1:] + [None]):
        end = nxt.start() if nxt else len(body)
        out[mark.group(1)] = body[mark.end() : end].strip()
    return out


def missing_fields(header: dict) -> list[str]:
    return [f for f in ("Subject",) + FIELDS if not header.get(f)]


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def concern(subject: str) -> str:
    return re.sub(r"^(\[[^\]]*\]\s*)+", "", subject)


def series_table(series: list[str] | None = None) -> str:
    series = read_series() if series is None else series
    rows = [
        "| Order | Patch | Concern | Upstream-Status | Remove-When |",
        "|---|---|---|---|---|",
    ]
    for order, name in enumerate(series, 1):
        h = patch_header((PATCHES / name).read_text())
        cells = [
            str(order),
            f"`{name}`",
            concern(h["Subject"]),
            _one_line(h.get("Upstream-Status", "")),
            _one_line(h.get("Remove-When", "")),
        ]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def readme_with_table(readme: str, table: str) -> str:
    if START not in readme or END not in readme:
        raise ToolError(f"docs/series.md has no {START} ... {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}{END}{tail}"


def check() -> None:
    problems = []
    for name in read_series():
        missing = missing_fields(patch_header((PATCHES / name).read_text()))
        if missing:
            problems.append(f"patches/{name}: no {', '.join(missing)}")
    if problems:
        raise ToolError(
            "patch headers must have "
            + ", ".join(("Subject",) + FIELDS)
            + ":\n  "
            + "\n  ".join(problems)
        )
    print(f"{len(read_series())} patch headers complete")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("check")
    p = sub.add_parser("table")
    p.add_argument("--check", action="store_true", help="fail if README is stale")
    args = ap.parse_args()
    if args.command == "check":
        check()
        return
    readme = README.read_text()
    new = readme_with_table(readme, series_table())
    if new == readme:
        print("docs/series.md series table is current")
    elif args.check:
        raise ToolError("docs/series.md series table is stale: run `make series-table`")
    else:
        README.write_text(new)
        print("docs/series.md series table updated")


if __name__ == "__main__":
    run_main(main)
