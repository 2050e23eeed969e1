#!/usr/bin/env python3
"""Apply, refresh and check the quilt-style patch series.

    python scripts/series.py apply [--force]   # build/src = upstream + one commit per patch
    python scripts/series.py refresh           # build/src commits -> patches/ + series
    python scripts/series.py check-patch DIR   # apply to DIR with plain `patch -p1 --fuzz=0`
    python scripts/series.py check-quilt DIR   # apply to DIR with `quilt push -a --fuzz=0`

Strictness: every hunk must apply at its recorded position (no fuzz, no offset).
A patch that does not is named, with its failing hunks, and nothing of it is
applied: build/src then holds upstream plus the patches before it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from common import (
    BUILD,
    PATCH_AUTHOR,
    PATCH_DATE,
    PATCHES,
    UPSTREAM_TAG,
    ToolError,
    git,
    git_env,
    read_series,
    run_main,
)
from headers import patch_subject

import upstream

SRC = BUILD / "src"
FORMAT_PATCH_ARGS = (
    "format-patch",
    "-1",
    "--stdout",
    "--zero-commit",
    "--no-signature",
    "--no-numbered",
    "--full-index",
    "--no-renames",
    "-p",  # no diffstat
    "--src-prefix=a/",
    "--dst-prefix=b/",
)
NOT_CLEAN = re.compile(
    r"(FAILED|with fuzz|offset -?\d+ line|Reversed|malformed|garbage|"
    r"can't find file|No file to patch|ignored|Skipping patch)",
    re.I,
)
# Lines that only name a file or a patch (a patch may be named "...malformed...").
NAMING_LINE = re.compile(r"^(patching file|checking file|Applying patch|Now at patch) ")


def unclean(output: str) -> list[str]:
    """The lines of patch/quilt output that say a hunk did not apply cleanly."""
    return [
        line
        for line in output.splitlines()
        if NOT_CLEAN.search(line) and not NAMING_LINE.match(line)
    ]


# ---------------------------------------------------------------- strict check
@dataclass
class Hunk:
    file: str
    number: int  # 1-based within the file, as GNU patch counts
    header: str


def _hunks(patch_file: Path) -> dict[tuple[str, int], Hunk]:
    """Hunk headers of a patch, keyed by (file, 1-based hunk number in file)."""
    lines = patch_file.read_text(errors="replace").splitlines()
    hunks, current, count = {}, None, 0
    for i, line in enumerate(lines):
        if (
            line.startswith("--- ")
            and i + 1 < len(lines)
            and lines[i + 1].startswith("+++ ")
        ):
            old, new = (x[4:].split("\t")[0] for x in (line, lines[i + 1]))
            path = new if new != "/dev/null" else old
            current = path.split("/", 1)[1] if "/" in path else path
            count = 0
        elif line.startswith("@@ ") and current is not None:
            count += 1
            hunks[(current, count)] = Hunk(current, count, line)
    return hunks


def strict_problems(tree: Path, patch_file: Path) -> list[str]:
    """Dry-run ``patch -p1 --fuzz=0``; return one message per hunk that would not
    apply exactly at its recorded position (empty when the patch is clean)."""
    proc = subprocess.run(
        [
            "patch",
            "-p1",
            "--dry-run",
            "--fuzz=0",
            "--batch",
            "--forward",
            "-d",
            str(tree),
            "-i",
            str(patch_file.resolve()),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C"},
    )
    hunks = _hunks(patch_file)
    problems, current = [], "?"
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r"(?:checking|patching) file (.+)", line)
        if m:
            current = m.group(1).strip("'\"")
            continue
        m = re.match(r"Hunk #(\d+) (.*)", line)
        if m:
            msg = m.group(2)
            if NOT_CLEAN.search(msg):
                hunk = hunks.get((current, int(m.group(1))))
                where = hunk.header if hunk else "?"
                problems.append(f"{current} hunk #{m.group(1)} ({where}): {msg}")
            continue
        if unclean(line):
            problems.append(f"{current}: {line.strip()}")
    if proc.returncode != 0 and not problems:
        problems.append(f"patch exited {proc.returncode}: {proc.stdout[-1500:]}")
    return problems


# ---------------------------------------------------------------------- export
def export_commit(repo: Path, commit: str) -> str:
    """The commit as a deterministic format-patch: fixed author and date."""
    text = git(repo, *FORMAT_PATCH_ARGS, commit)
    head, sep, body = text.partition("\nSubject: ")
    # A long From header is folded onto continuation lines: replace them too.
    head = re.sub(
        r"(?m)^From: .*(?:\n[ \t].*)*$", f"From: {PATCH_AUTHOR}", head, count=1
    )
    head = re.sub(r"(?m)^Date: .*$", f"Date: {PATCH_DATE}", head, count=1)
    return head + sep + body


def _layout(repo: Path) -> list[str]:
    """Commits from the upstream base to HEAD; refuse any other layout."""
    if not (repo / ".git").exists():
        raise ToolError(f"{repo} is not a git repository; run `make apply` first")
    base = git(
        repo, "rev-parse", "-q", "--verify", f"{UPSTREAM_TAG}^{{commit}}", check=False
    ).strip()
    if not base:
        raise ToolError(
            f"{repo} has no '{UPSTREAM_TAG}' tag marking the pristine wheel"
        )
    roots = git(repo, "rev-list", "--max-parents=0", "HEAD").split()
    if roots != [base]:
        raise ToolError(
            f"unexpected commit layout in {repo}: HEAD must descend from the "
            f"'{UPSTREAM_TAG}' commit only (roots: {', '.join(r[:12] for r in roots)})"
        )
    merges = git(repo, "rev-list", "--min-parents=2", f"{base}..HEAD").split()
    if merges:
        raise ToolError(
            f"unexpected commit layout in {repo}: merge commit(s) {', '.join(m[:12] for m in merges)}; "
            "the series must be a linear stack of commits"
        )
    return git(repo, "rev-list", "--reverse", f"{base}..HEAD").split()


def uncommitted_changes(repo: Path) -> str:
    return git(repo, "status", "--porcelain", "--untracked-files=all").strip()


# ----------------------------------------------------------------------- apply
def _guard_existing(src: Path, series: list[str]) -> None:
    """Refuse to replace a build/src holding work that is not in patches/."""
    if not src.exists():
        return
    if not (src / ".git").exists():
        raise ToolError(
            f"{src} exists but is not a git repository; remove it or use FORCE=1"
        )
    dirty = uncommitted_changes(src)
    if dirty:
        raise ToolError(
            f"{src} has uncommitted changes:\n{dirty[:800]}\n"
            "commit them and run `make refresh`, or discard them with FORCE=1"
        )
    problems = unexported(src, series)
    if problems:
        raise ToolError(
            f"{src} holds work that is not in patches/:\n  "
            + "\n  ".join(problems)
            + "\nrun `make refresh` to export it, or FORCE=1 to discard it"
        )


def unexported(src: Path, series: list[str]) -> list[str]:
    """How the commits of ``src`` differ from the series (empty: every commit
    exports byte for byte to its patch file, in order)."""
    commits = _layout(src)
    problems = []
    if len(commits) != len(series):
        problems.append(f"{len(commits)} patch commits, the series lists {len(series)}")
    for commit, name in zip(commits, series):
        path = PATCHES / name
        if not path.is_file() or export_commit(src, commit) != path.read_text():
            subject = git(src, "log", "-1", "--format=%s", commit).strip()
            problems.append(
                f"commit {commit[:12]} {subject!r} differs from patches/{name}"
            )
    return problems


def _copy_pristine(pristine: Path, dest: Path) -> None:
    # The unpacked wheel is imported by the tests' upstream servers; bytecode
    # written there is no part of the release (nor of the wheel built here).
    shutil.copytree(
        pristine,
        dest,
        symlinks=True,
        ignore=shutil.ignore_patterns(upstream.STAMP, "__pycache__"),
    )


def init_tree(pristine: Path, wheel_name: str, dest: Path) -> None:
    _copy_pristine(pristine, dest)
    git(dest, "init", "-q", "-b", "main")
    # The tree's own config, not only this tool's git calls: a user's commit
    # or rebase in build/src must not start a background `git gc --auto`
    # (thousands of loose objects after the upstream commit), which has lost
    # the upstream tag and raced the next apply's removal of the tree.
    git(dest, "config", "gc.auto", "0")
    git(dest, "config", "maintenance.auto", "false")
    git(dest, "add", "-A")
    git(
        dest,
        "commit",
        "-q",
        "-m",
        f"upstream: {wheel_name}\n\nPristine unpacked wheel.",
    )
    git(dest, "tag", UPSTREAM_TAG)
    # Pack the upstream commit's objects (thousands of loose files otherwise).
    git(
        dest,
        "-c",
        "pack.compression=1",
        "repack",
        "-d",
        "-q",
        "--window=0",
        "--depth=0",
    )


def _swap_in(new: Path, dest: Path) -> None:
    """Put ``new`` at ``dest``; the old tree is moved aside, not deleted, until
    the new one is in place (a failed removal leaves only a stale copy)."""
    old = dest.with_name(dest.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if dest.exists():
        os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)


def am_strict(tree: Path, patch_file: Path) -> list[str]:
    """Commit one patch onto ``tree`` with ``git am`` if it applies at zero
    fuzz and zero offset; returns the problems (empty: committed)."""
    problems = strict_problems(tree, patch_file)
    if problems:
        return problems
    proc = subprocess.run(
        [
            "git",
            "-C",
            str(tree),
            "am",
            "-q",
            "--keep-non-patch",
            "--no-3way",
            "--whitespace=nowarn",
            str(patch_file.resolve()),
        ],
        capture_output=True,
        text=True,
        env=git_env(),
    )
    if proc.returncode != 0:
        git(tree, "am", "--abort", check=False)
        return [proc.stderr.strip() or proc.stdout.strip()]
    return []


def apply_series(tree: Path, series: list[str]):
    """Commit the series onto ``tree`` in order; ``(index, name, problems)``
    of the first patch that does not apply strictly, else None."""
    for index, name in enumerate(series, 1):
        problems = am_strict(tree, PATCHES / name)
        if problems:
            return index, name, problems
    return None


def apply(force: bool = False) -> Path:
    series = read_series()
    check_series_files(series)
    wheel, pristine = upstream.prepare()
    if not force:
        _guard_existing(SRC, series)
    tmp = BUILD / "src.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    init_tree(pristine, wheel.name, tmp)
    failure = apply_series(tmp, series)
    _swap_in(tmp, SRC)
    if failure:
        index, name, problems = failure
        raise ToolError(
            f"patch {index}/{len(series)} {name} does not apply cleanly to "
            f"{wheel.name} (zero fuzz, zero offset required):\n  "
            + "\n  ".join(problems)
            + f"\nnothing of {name} was applied; {SRC} holds upstream plus the "
            f"{index - 1} patch(es) before it. Fix the patch (or rebase it in "
            "build/src and `make refresh`), then run `make apply` again."
        )
    print(f"applied {len(series)} patch(es) onto {wheel.name} in {SRC}")
    return SRC


# --------------------------------------------------------------------- refresh
def _slug(subject: str) -> str:
    subject = re.sub(r"^(\[[^\]]*\]\s*)+", "", subject)
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return slug[:52].rstrip("-") or "patch"


def _new_name(group: str, subject: str, taken: list[str]) -> str:
    numbers = [
        int(m.group(1))
        for n in taken
        if (m := re.match(rf"{re.escape(group)}/(\d{{4}})-", n))
    ]
    return f"{group}/{max(numbers, default=0) + 1:04d}-{_slug(subject)}.patch"


def _append_series(lines: list[str], group: str, name: str) -> list[str]:
    """Append a new patch at the end of the series (commits map to entries by
    position, so a new commit at the top of build/src is the last entry); open
    a comment block for its group unless the series already ends in it."""
    entries = [l.split("#", 1)[0].strip() for l in lines]
    entries = [e.split()[0] for e in entries if e]
    if entries and entries[-1].startswith(group + "/"):
        return lines + [name]
    tail = []
    for line in reversed(lines):
        if line.split("#", 1)[0].strip():
            break
        tail.append(line)
    if any(l.startswith(f"# == {group}:") or l == f"# == {group} ==" for l in tail):
        return lines + [name]
    return lines + ["", f"# == {group} ==", name]


def _patch_id(diff: str) -> str:
    proc = subprocess.run(
        ["git", "patch-id", "--stable"],
        input=diff,
        capture_output=True,
        text=True,
        env=git_env(),
    )
    return proc.stdout.split()[0] if proc.stdout.strip() else ""


def missing_patches(series: list[str]) -> list[str]:
    return [name for name in series if not (PATCHES / name).is_file()]


def check_series_files(series: list[str]) -> None:
    missing = missing_patches(series)
    if missing:
        raise ToolError(
            "patches/series lists patch file(s) that do not exist: "
            + ", ".join(f"patches/{m}" for m in missing)
            + " (renamed or deleted? fix the series entry or restore the file)"
        )


def match_commits(repo: Path, commits: list[str], series: list[str]) -> list:
    """The series entry of each commit (None: a new commit), by identity.

    A commit is its patch by subject; a commit whose subject changed is its
    patch by content (``git patch-id``). Two patches or two commits with one
    subject, or a patch that matches no commit either way, are refused:
    writing by position would put one commit's diff into another's file.
    """
    subjects = {name: patch_subject((PATCHES / name).read_text()) for name in series}
    by_subject: dict[str, str] = {}
    for name, subject in subjects.items():
        if subject in by_subject:
            raise ToolError(
                f"patches/{by_subject[subject]} and patches/{name} have the same "
                f"subject {subject!r}; give each patch its own subject"
            )
        by_subject[subject] = name
    commit_subjects = [
        git(repo, "log", "-1", "--format=%s", c).strip() for c in commits
    ]
    seen: dict[str, str] = {}
    for c, subject in zip(commits, commit_subjects):
        if subject in seen:
            raise ToolError(
                f"commits {seen[subject][:12]} and {c[:12]} in {repo} have the "
                f"same subject {subject!r}; give each commit its own subject"
            )
        seen[subject] = c
    matched = [by_subject.get(subject) for subject in commit_subjects]
    left = [n for n in series if n not in matched]
    if left and None in matched:
        ids = {_patch_id((PATCHES / n).read_text()): n for n in left}
        for i, c in enumerate(commits):
            if matched[i] is None:
                name = ids.get(_patch_id(git(repo, "show", "--format=", c)))
                if name is not None and name not in matched:
                    matched[i] = name
        left = [n for n in series if n not in matched]
    if left:
        new = [
            f"{c[:12]} {s!r}"
            for c, s, m in zip(commits, commit_subjects, matched)
            if m is None
        ]
        raise ToolError(
            "no commit in "
            f"{repo} matches "
            + ", ".join(f"patches/{n}" for n in left)
            + " by subject or by content"
            + (f" (unmatched commits: {', '.join(new)})" if new else "")
            + ": a commit was dropped, or reworded and changed at once. Keep its "
            "subject to update it (or its diff to reword it), restore it, or "
            "remove the patch from patches/series by hand."
        )
    return matched


def _series_lines(
    lines: list[str], order: list[str], new: dict[int, tuple[str, str]]
) -> list[str]:
    """The series file with its entries in ``order`` (commit order) and new
    entries (index in ``order`` -> (group, name)) after their predecessor."""
    slots = [i for i, l in enumerate(lines) if l.split("#", 1)[0].strip()]
    existing = [n for i, n in enumerate(order) if i not in new]
    out = list(lines)
    for slot, name in zip(slots, existing):
        out[slot] = name
    for index in sorted(new):
        group, name = new[index]
        if index == len(order) - 1 and all(i in new for i in range(index, len(order))):
            out = _append_series(out, group, name)
            continue
        prev = order[index - 1] if index else None
        at = (
            next(i for i, l in enumerate(out) if l.split("#", 1)[0].strip() == prev) + 1
            if prev
            else slots[0] if slots else len(out)
        )
        out.insert(at, name)
    return out


def refresh(group: str | None = None) -> list[str]:
    series_file = PATCHES / "series"
    series = read_series(series_file)
    check_series_files(series)
    if not SRC.exists():
        raise ToolError(f"{SRC} does not exist; run `make apply` first")
    dirty = uncommitted_changes(SRC)
    if dirty:
        raise ToolError(
            f"{SRC} has uncommitted changes; commit them first:\n{dirty[:800]}"
        )
    commits = _layout(SRC)
    matched = match_commits(SRC, commits, series)
    lines = series_file.read_text().splitlines()
    order: list[str] = []
    new: dict[int, tuple[str, str]] = {}
    for i, (commit, name) in enumerate(zip(commits, matched)):
        if name is None:
            subject = git(SRC, "log", "-1", "--format=%s", commit).strip()
            neighbour = order[-1] if order else next((m for m in matched if m), None)
            grp = group or (neighbour.split("/")[0] if neighbour else "misc")
            name = _new_name(grp, subject, series + order)
            new[i] = (grp, name)
        order.append(name)
    written = []
    for commit, name in zip(commits, order):
        path = PATCHES / name
        text = export_commit(SRC, commit)
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(name)
    new_series = "\n".join(_series_lines(lines, order, new)) + "\n"
    if series_file.read_text() != new_series:
        series_file.write_text(new_series)
        written.append("series")
    reordered = [n for n in order if n in series] != series
    print(
        f"refreshed {len(commits)} patch(es); "
        + (f"updated: {', '.join(written)}" if written else "no changes")
        + ("; series reordered to the commit order" if reordered else "")
    )
    return written


# ----------------------------------------------------- plain patch and quilt
def check_patch(tree: Path) -> None:
    for name in read_series():
        proc = subprocess.run(
            [
                "patch",
                "-p1",
                "--fuzz=0",
                "--batch",
                "--forward",
                "-d",
                str(tree),
                "-i",
                str((PATCHES / name).resolve()),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "LC_ALL": "C"},
        )
        out = proc.stdout + proc.stderr
        if proc.returncode != 0 or unclean(out):
            raise ToolError(f"`patch -p1 --fuzz=0` failed on {name}:\n{out}")


def check_quilt(tree: Path) -> None:
    if not shutil.which("quilt"):
        raise ToolError("quilt is not installed (apt-get install quilt)")
    if not read_series():
        return
    env = {
        **os.environ,
        "QUILT_PATCHES": str(PATCHES.resolve()),
        "QUILT_PC": ".pc",
        "QUILT_PATCH_OPTS": "--fuzz=0 --unified",
        "LC_ALL": "C",
    }
    proc = subprocess.run(
        ["quilt", "--quiltrc", "-", "push", "-a", "--fuzz=0"],
        cwd=tree,
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 or unclean(out):
        raise ToolError(f"`quilt push -a --fuzz=0` failed:\n{out}")
    shutil.rmtree(tree / ".pc", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("apply")
    p.add_argument(
        "--force", action="store_true", default=os.environ.get("FORCE") == "1"
    )
    p = sub.add_parser("refresh")
    p.add_argument("--group", default=os.environ.get("GROUP") or None)
    for name in ("check-patch", "check-quilt"):
        p = sub.add_parser(name)
        p.add_argument("tree", type=Path)
    args = ap.parse_args()
    if args.command == "apply":
        apply(args.force)
    elif args.command == "refresh":
        refresh(args.group)
    elif args.command == "check-patch":
        check_patch(args.tree)
    else:
        check_quilt(args.tree)


if __name__ == "__main__":
    run_main(main)
