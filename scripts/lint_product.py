#!/usr/bin/env python3
"""Upstream's own linters on the product files the series adds or changes.

    python3 scripts/lint_product.py                # build/src against its upstream tag
    python3 scripts/lint_product.py --report FILE  # also write the full diffs to FILE
    python3 scripts/lint_product.py --pristine     # the changed files as the release has them
    python3 scripts/lint_product.py --fix          # apply isort, ruff format, ruff --fix

Runs upstream SGLang 0.5.23's pre-commit linters, at its versions
(requirements/lint-upstream.txt, venv build/lint-upstream) and with its settings
(scripts/upstream_lint/), on every Python file the series adds or changes:
isort, ``ruff format``, ``ruff check`` (F401, F821, UP037; not on
``__init__.py``) and codespell. Each new non-empty module must also open with
upstream's Apache license header. Whole files are checked: the release's own
copies of the changed files pass every one of these tools (``--pristine``
checks that, tests/tooling/test_lint_product.py keeps it so).

``make lint`` runs it on build/src; ``make pr-check`` (scripts/pr_check.py) on
the PR's tree: the files its patches add or change and the test files it
carries. A failure names each file and tool, with the change the formatter
would make. ``--fix`` rewrites the files in place (then commit them as fixups
of their patches); the license header and spelling stay to be done by hand.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common import BUILD, ROOT, UPSTREAM_TAG, ToolError, git, run_main

CONFIG = ROOT / "scripts" / "upstream_lint"
# Beside .venv, not under SGL_BUILD_DIR: the sandboxed tooling tests share it.
TOOLS_BIN = Path(
    os.environ.get("SGL_LINT_UPSTREAM_BIN", ROOT / "build" / "lint-upstream" / "bin")
)

# The header upstream's modules open with (the copyright years vary).
LICENSE_HEADER = re.compile(
    r"\A(?:#![^\n]*\n)?"
    r"# Copyright \d{4}(?:-\d{4})? SGLang Team\n"
    + re.escape(
        '# Licensed under the Apache License, Version 2.0 (the "License");\n'
        "# you may not use this file except in compliance with the License.\n"
        "# You may obtain a copy of the License at\n"
        "#\n"
        "#     http://www.apache.org/licenses/LICENSE-2.0\n"
        "#\n"
        "# Unless required by applicable law or agreed to in writing, software\n"
        '# distributed under the License is distributed on an "AS IS" BASIS,\n'
        "# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.\n"
        "# See the License for the specific language governing permissions and\n"
        "# limitations under the License.\n"
        "# " + "=" * 78 + "\n"
    )
)


@dataclass
class Finding:
    path: str
    tool: str
    detail: str  # what the tool says about this file (a diff, messages)


def _tool(name: str) -> str:
    exe = TOOLS_BIN / name
    if not exe.exists():
        raise ToolError(
            f"{exe} missing: upstream's linters live in their own venv "
            "(make lint creates it from requirements/lint-upstream.txt)"
        )
    return str(exe)


def _run(tree: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=tree, capture_output=True, text=True)


def tree_files(tree: Path, base: str = UPSTREAM_TAG) -> tuple[list[str], list[str]]:
    """The .py files of ``tree`` (a git repository) that differ from ``base``:
    (added or changed, added). Uncommitted edits and untracked files count."""
    changed = git(tree, "diff", "--name-only", "--diff-filter=AM", base, "--", "*.py")
    added = git(tree, "diff", "--name-only", "--diff-filter=A", base, "--", "*.py")
    untracked = git(tree, "ls-files", "--others", "--exclude-standard", "--", "*.py")
    new = sorted(set(added.split()) | set(untracked.split()))
    return sorted(set(changed.split()) | set(new)), new


def patch_files(patches: list[Path]) -> tuple[list[str], list[str]]:
    """The .py files these patches (-p1) add or change: (added or changed, added)."""
    files, new = [], []
    for patch in patches:
        text = patch.read_text()
        for old, rel in re.findall(r"(?m)^--- (\S+).*\n\+\+\+ b/(\S+\.py)\s*$", text):
            if rel not in files:
                files.append(rel)
            if old == "/dev/null" and rel not in new:
                new.append(rel)
    return files, new


def _isort(tree: Path, files: list[str]) -> list[Finding]:
    base = [_tool("isort"), "--settings-file", str(CONFIG / "isort.cfg")]
    proc = _run(tree, base + ["--check-only", *files])
    bad = re.findall(r"ERROR: (\S+) Imports are incorrectly sorted", proc.stderr)
    if proc.returncode and not bad:
        raise ToolError(f"isort failed: {proc.stderr.strip()[-2000:]}")
    out = []
    for path in bad:
        rel = os.path.relpath(path, tree) if os.path.isabs(path) else path
        diff = _run(tree, base + ["--diff", "--check-only", rel]).stdout
        diff = diff.replace(str(tree.resolve()) + os.sep, "")
        out.append(Finding(rel, "isort", diff))
    return out


def _ruff_format(tree: Path, files: list[str]) -> list[Finding]:
    base = [_tool("ruff"), "format", "--config", str(CONFIG / "ruff.toml")]
    proc = _run(tree, base + ["--no-cache", "--check", *files])
    bad = re.findall(r"(?m)^Would reformat: (\S+)$", proc.stdout)
    if proc.returncode and not bad:
        raise ToolError(f"ruff format failed: {(proc.stdout + proc.stderr)[-2000:]}")
    return [
        Finding(
            rel, "ruff format", _run(tree, base + ["--no-cache", "--diff", rel]).stdout
        )
        for rel in bad
    ]


def _ruff_check(tree: Path, files: list[str]) -> list[Finding]:
    files = [f for f in files if Path(f).name != "__init__.py"]
    if not files:
        return []
    argv = [_tool("ruff"), "check", "--config", str(CONFIG / "ruff.toml")]
    proc = _run(tree, argv + ["--no-cache", "--output-format", "concise", *files])
    hits = re.findall(r"(?m)^(\S+?):(\d+:\d+: .*)$", proc.stdout)
    if proc.returncode and not hits:
        raise ToolError(f"ruff check failed: {(proc.stdout + proc.stderr)[-2000:]}")
    return _grouped(hits, "ruff check")


def _codespell(tree: Path, files: list[str]) -> list[Finding]:
    argv = [_tool("codespell"), "--config", str(CONFIG / "codespellrc"), *files]
    proc = _run(tree, argv)
    hits = re.findall(r"(?m)^(\S+?):(\d+: .*)$", proc.stdout)
    if proc.returncode and not hits:
        raise ToolError(f"codespell failed: {(proc.stdout + proc.stderr)[-2000:]}")
    return _grouped(hits, "codespell")


def _grouped(hits: list[tuple[str, str]], tool: str) -> list[Finding]:
    by_file: dict[str, list[str]] = {}
    for path, message in hits:
        by_file.setdefault(path, []).append(f"{path}:{message}")
    return [Finding(p, tool, "\n".join(m) + "\n") for p, m in by_file.items()]


def _headers(tree: Path, new: list[str]) -> list[Finding]:
    out = []
    for rel in new:
        text = (tree / rel).read_text()
        if text.strip() and not LICENSE_HEADER.match(text):
            first = text.splitlines()[0] if text else ""
            out.append(
                Finding(
                    rel,
                    "license header",
                    f"{rel}: a new module without upstream's Apache license "
                    f"header (first line: {first[:70]!r})\n",
                )
            )
    return out


def format_files(root: Path, files: list[str], fix: bool = False) -> None:
    """isort and ``ruff format`` with upstream's settings over ``files``
    (relative to ``root``), in place; with ``fix`` first ``ruff check --fix``
    (unused imports, quoted annotations; what it cannot fix, lint reports)."""
    ruff = [_tool("ruff"), "--config", str(CONFIG / "ruff.toml"), "--no-cache", "-q"]
    if fix:
        checked = [f for f in files if Path(f).name != "__init__.py"]
        if checked:
            _run(root, [ruff[0], "check", "--fix", *ruff[1:], *checked])
    isort = [_tool("isort"), "--settings-file", str(CONFIG / "isort.cfg"), "-q"]
    for argv in (isort, [ruff[0], "format", *ruff[1:]]):
        proc = _run(root, argv + files)
        if proc.returncode != 0:
            raise ToolError(f"{Path(argv[0]).name} failed:\n{proc.stderr[-2000:]}")


def lint(tree: Path, files: list[str], new: list[str] = ()) -> list[Finding]:
    """Every finding of upstream's linters on ``files`` (relative to ``tree``)
    and of the header check on the new modules ``new``."""
    files = [f for f in files if (tree / f).is_file()]
    if not files:
        return []
    findings = (
        _isort(tree, files)
        + _ruff_format(tree, files)
        + _ruff_check(tree, files)
        + _codespell(tree, files)
        + _headers(tree, [f for f in new if f in files])
    )
    return sorted(findings, key=lambda f: (f.path, f.tool))


def report(findings: list[Finding], what: str, report_file: Path | None = None) -> None:
    """Print one line per file and tool (and the diffs to ``report_file``);
    ToolError when there is any finding."""
    if report_file is not None:
        body = [f"== {f.path}: {f.tool}\n{f.detail}" for f in findings]
        report_file.write_text("".join(body) or "no findings\n")
    if not findings:
        print(f"upstream's linters pass on {what}")
        return
    for f in findings:
        print(f"{f.path}: {f.tool}", file=sys.stderr)
        if report_file is None:
            print(f.detail, file=sys.stderr)
    tools = sorted({f.tool for f in findings})
    raise ToolError(
        f"{len(findings)} finding(s) of upstream's linters ({', '.join(tools)}) "
        f"on {what}"
        + (f"; the diffs are in {report_file}" if report_file is not None else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=BUILD / "src")
    parser.add_argument("--base", default=UPSTREAM_TAG)
    parser.add_argument("--report", type=Path)
    parser.add_argument(
        "--fix",
        action="store_true",
        help="rewrite the files with isort, ruff check --fix and ruff format",
    )
    parser.add_argument(
        "--pristine",
        action="store_true",
        help="check the base's own copies of the changed files instead",
    )
    args = parser.parse_args()
    if not (args.tree / ".git").exists():
        raise ToolError(f"{args.tree} is no git tree (make apply builds build/src)")
    files, new = tree_files(args.tree, args.base)
    if args.pristine:
        changed = [f for f in files if f not in new]
        with tempfile.TemporaryDirectory() as scratch:
            for rel in changed:
                dest = Path(scratch) / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(git(args.tree, "show", f"{args.base}:{rel}"))
            what = f"{len(changed)} changed file(s) as {args.base} has them"
            report(lint(Path(scratch), changed), what, args.report)
        return
    if args.fix:
        format_files(args.tree, [f for f in files if (args.tree / f).is_file()], True)
    what = f"{len(files)} file(s) the series adds or changes in {args.tree}"
    report(lint(args.tree, files, new), what, args.report)


if __name__ == "__main__":
    run_main(main)
