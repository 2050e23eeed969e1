#!/usr/bin/env python3
"""How the series applies to another SGLang release (``make drift VERSION=X``).

    python scripts/drift.py 0.5.22                 # download the release's wheel
    python scripts/drift.py 0.5.22 --wheel PATH    # or use a local copy
    python scripts/drift.py X --tree DIR           # or an unpacked release tree

The wheel is fetched with ``pip download`` for this interpreter and machine,
reported as *unpinned* with the sha256 it got (nothing checks it against a
pin), and unpacked into ``build/drift/<wheel stem>/`` (scratch). Each patch of
the series is then tried in order with ``patch -p1`` and classified:

* ``clean``: every hunk applies at its recorded position (what ``make apply``
  demands);
* ``offset``: every hunk applies, some at other lines;
* ``fuzz``: every hunk applies, some only with fuzz (context lines differ);
* ``conflict``: some hunk does not apply at fuzz 2 (or a file is missing).

A patch that applies (clean, offset, fuzz) is applied, so the next patch sees
it; a conflicting one is not, so patches that build on it may conflict too.
Prints a table (patch, status, the files and hunks that are not clean) and
writes JSON (``--json``, default ``build/drift/drift-<version>.json``).
Nothing here changes the pin, the series or ``build/src``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from common import BUILD, PATCHES, ToolError, read_series, run_main

import upstream

DRIFT = BUILD / "drift"
STATUSES = ("clean", "offset", "fuzz", "conflict")
_HUNK = re.compile(r"Hunk #(\d+) (succeeded|FAILED|ignored)(.*)")


def fetch(version: str, dest: Path) -> Path:
    """The release's wheel for this interpreter and machine (unpinned)."""
    tag = upstream.default_python_tag()
    plat = upstream.default_platform()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        proc = upstream.pip_download(f"sglang=={version}", tag, plat, Path(tmp))
        got = list(Path(tmp).glob("sglang-*.whl"))
        if proc.returncode != 0 or len(got) != 1:
            raise ToolError(
                f"could not download sglang {version} for {tag}/{plat}:\n"
                f"{proc.stderr.strip()[-2000:]}"
            )
        path = dest / got[0].name
        os.replace(got[0], path)
    return path


def unpack(wheel: Path, root: Path) -> Path:
    tree = root / wheel.name[: -len(".whl")]
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tree)
    return tree


def _patch(tree: Path, patch_file: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["patch", "-p1", "--batch", "--forward", "-d", str(tree), "-i"]
        + [str(patch_file.resolve()), *extra],
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C"},
    )


def classify(output: str, returncode: int) -> tuple[str, list[str]]:
    """Status and the non-clean hunks (``file hunk #N: message``) of a
    ``patch`` run's output."""
    status, notes, current = "clean", [], "?"
    for line in output.splitlines():
        m = re.match(r"(?:checking|patching) file (.+)", line)
        if m:
            current = m.group(1).strip("'\"")
            continue
        m = re.match(r"\|\+\+\+ [ab]/(\S+)", line)  # the header of a missing file
        if m:
            current = m.group(1)
            continue
        m = _HUNK.match(line)
        if m:
            number, verdict, rest = m.groups()
            rest = rest.strip().rstrip(".")
            if verdict != "succeeded":
                status = "conflict"
            elif "fuzz" in rest and status != "conflict":
                status = "fuzz"
            elif "offset" in rest and status == "clean":
                status = "offset"
            notes.append(f"{current} hunk #{number}: {verdict} {rest}".strip())
        elif re.search(r"can't find file|No file to patch|malformed", line):
            status = "conflict"
            notes.append(f"{current}: {line.strip()}")
    if returncode != 0 and status != "conflict":
        status = "conflict"
        notes.append(f"patch exited {returncode}")
    return status, notes


def drift(tree: Path, series: list[str]) -> list[dict]:
    rows = []
    for index, name in enumerate(series, 1):
        patch_file = PATCHES / name
        if not patch_file.is_file():
            raise ToolError(f"patches/series lists a missing file: patches/{name}")
        dry = _patch(tree, patch_file, "--dry-run", "--fuzz=2")
        status, notes = classify(dry.stdout + dry.stderr, dry.returncode)
        if status != "conflict":
            real = _patch(tree, patch_file, "--fuzz=2", "--no-backup-if-mismatch")
            if real.returncode != 0:
                status, notes = "conflict", notes + [real.stdout[-500:]]
        rows.append({"order": index, "patch": name, "status": status, "hunks": notes})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", help="the SGLang release to try, e.g. 0.5.22")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--wheel", type=Path, help="a local wheel of that release")
    src.add_argument("--tree", type=Path, help="an unpacked release tree")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    series = read_series()
    missing = [n for n in series if not (PATCHES / n).is_file()]
    if missing:
        raise ToolError(
            "patches/series lists missing file(s): "
            + ", ".join(f"patches/{m}" for m in missing)
        )
    source: dict = {"version": args.version, "pinned": False}
    scratch = DRIFT / f"sglang-{args.version}"
    if args.tree:
        if not (args.tree / "sglang").is_dir():
            raise ToolError(f"--tree {args.tree} has no sglang/ package")
        tree = scratch / "tree"
        if tree.exists():
            shutil.rmtree(tree)
        shutil.copytree(args.tree, tree, symlinks=True)
        source["tree"] = str(args.tree)
    else:
        wheel = args.wheel or fetch(args.version, DRIFT / "wheels")
        if not wheel.is_file():
            raise ToolError(f"--wheel {wheel} not found")
        source["wheel"] = wheel.name
        source["sha256"] = upstream.sha256_of(wheel)
        print(
            f"{wheel.name}: unpinned, sha256 {source['sha256']} (not checked "
            "against any pin)"
        )
        tree = unpack(wheel, scratch)
    rows = drift(tree, series)
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    width = max(len(r["patch"]) for r in rows)
    print(f"\nseries onto sglang {args.version}:")
    for r in rows:
        print(f"{r['order']:>3} {r['patch']:<{width}}  {r['status']}")
        if r["status"] != "clean":
            for note in r["hunks"]:
                if not note.endswith("succeeded"):
                    print(f"      {note}")
    print(
        f"\n{len(rows)} patches: "
        + ", ".join(f"{counts[s]} {s}" for s in STATUSES)
        + " (make apply needs every one clean)"
    )
    out = args.json or DRIFT / f"drift-{args.version}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**source, "counts": counts, "patches": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    run_main(main)
