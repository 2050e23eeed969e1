"""The results table of each benchmark folder, generated from its result JSON.

    python benchmark/results_index.py          # rewrite benchmark/<feature>/README.md tables
    python benchmark/results_index.py --check  # fail when a table is stale

One row per result file in ``benchmark/<feature>/results/`` (date from the file
name, the script and its arguments, git revision, series label, machine) and
one per run folder (``results/<run>/``, as the GPU runs are stored). The table
sits between two markers in the folder's README.md; a tooling test keeps it
current.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
START, END = "<!-- results-table -->", "<!-- /results-table -->"
_STAMP = re.compile(r"(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})\d{2}Z")


def _date(name: str) -> str:
    m = _STAMP.search(name)
    return f"{m[1]}-{m[2]}-{m[3]} {m[4]}:{m[5]}Z" if m else "–"


def _machine(data: dict) -> str:
    m = data.get("machine") or {}
    cpus = m.get("cpus")
    gpus = sorted({r.get("gpu") for r in data.get("gpu", []) if r.get("gpu")})
    parts = [f"{cpus} CPUs" if cpus else "", ", ".join(gpus)]
    return ", ".join(p for p in parts if p) or m.get("processor", "–")


def _cell(text) -> str:
    return str(text).replace("|", "\\|") if text not in (None, "") else "–"


def rows(feature: Path) -> list[str]:
    results = feature / "results"
    out = [
        "| Date | Result | Command | Revision | Series label | Machine |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        command = data.get("command", "")
        command = re.sub(r"^\S*python\S*\s+", "", command)
        out.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    _date(path.name),
                    f"[`{path.name}`](results/{path.name})",
                    f"`{command}`" if command else "",
                    str(data.get("git_revision", ""))[:8],
                    data.get("series_label"),
                    _machine(data),
                )
            )
            + " |"
        )
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        files = sorted(f.name for f in folder.iterdir() if f.is_file())
        out.append(
            f"| – | [`{folder.name}/`](results/{folder.name}/) | run folder: "
            f"{_cell(', '.join(files))} | – | – | – |"
        )
    return out


def readme_text(feature: Path) -> str:
    readme = feature / "README.md"
    table = "\n".join(rows(feature)) + "\n"
    text = (
        readme.read_text()
        if readme.is_file()
        else f"# {feature.name} benchmarks\n\n## Results\n\n{START}\n{END}\n"
    )
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{table}{END}{rest.split(END, 1)[1]}"


def features() -> list[Path]:
    return sorted(p.parent for p in HERE.glob("*/results") if p.is_dir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for feature in features():
        readme = feature / "README.md"
        new = readme_text(feature)
        if readme.is_file() and readme.read_text() == new:
            continue
        if args.check:
            stale.append(str(readme.relative_to(HERE.parent)))
        else:
            readme.write_text(new)
            print(f"updated {readme.relative_to(HERE.parent)}")
    if stale:
        print(
            "stale results tables: " + ", ".join(stale) + " (run "
            "`python benchmark/results_index.py`)",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
