#!/usr/bin/env python3
"""Carry the series to another SGLang release with git's 3-way merge
(``make rebase VERSION=X``).

    python scripts/rebase.py 0.5.22                  # download the release's wheel
    python scripts/rebase.py 0.5.22 --wheel PATH     # or use a local copy
    python scripts/rebase.py X --tree DIR            # or an unpacked release tree
    python scripts/rebase.py --continue              # after resolving a conflict
    python scripts/rebase.py --abort                 # drop build/rebase
    python scripts/rebase.py 0.5.22 --survey         # report only (see below)

One repository, ``build/rebase/src``: the pinned release (tag ``upstream``),
the series on it as ``make apply`` commits it (tag ``series``), and release X
as one commit on the pinned release (tag ``target``). Each series commit is
cherry-picked onto ``target`` in order: git merges 3-way, the base being the
pinned release plus the patches before it, so a patch whose context moved or
changed nearby carries where ``patch`` (``make drift``) needs fuzz or fails.
A patch whose change X already has is dropped (reported).

At the first conflict it stops and says what to do: resolve the files in
``build/rebase/src``, ``git add`` them and ``git cherry-pick --continue`` (or
``git cherry-pick --skip`` to drop the patch), then ``make rebase-continue``.

When every patch is carried, the commits are exported (same file names and
series order, dropped patches removed) into ``build/rebase/out/`` together
with a pin for X (``upstream/pin.toml``: the wheel used, its sha256 and size;
no pin from ``--tree``), and copied over ``patches/`` and the pin, but only
where those are committed in git, so that ``git diff`` shows the carry and
``git checkout`` undoes it. Do it on a branch of its own (one pin per branch:
docs/build.md says why), then ``make apply && make test``.

``--survey`` carries every patch that merges, skips the ones that conflict
(git's ``cherry-pick --abort``; patches building on them may conflict too),
prints per patch ``unchanged`` (exports to the same bytes), ``re-cut`` (merged,
its hunks moved or their context changed), ``upstream`` (X has it) or
``conflict`` (with files), writes JSON and changes nothing outside
``build/rebase``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import drift
import series as series_mod
from common import BUILD, PATCHES, PIN, ToolError, git, read_series, run_main

import upstream

REBASE = BUILD / "rebase"
SRC = REBASE / "src"
OUT = REBASE / "out"
STATE = REBASE / "state.json"
STATUSES = ("unchanged", "re-cut", "upstream", "conflict")


# ------------------------------------------------------------------ guards
def _uncommitted(paths: list[Path]) -> str:
    """Uncommitted changes to ``paths`` (a message), or "" when git tracks
    them unchanged. Outside a git work tree nothing can be undone: refused."""
    problems = []
    for path in paths:
        where = path if path.is_dir() else path.parent
        inside = git(where, "rev-parse", "--is-inside-work-tree", check=False)
        if inside.strip() != "true":
            problems.append(f"{path} is not in a git work tree")
            continue
        status = git(
            where, "status", "--porcelain", "--untracked-files=all", "--", str(path)
        ).strip()
        if status:
            problems.append(f"{path} has uncommitted changes:\n{status[:600]}")
    return "\n".join(problems)


def _guard_outputs() -> None:
    problems = _uncommitted([PATCHES, PIN])
    if problems:
        raise ToolError(
            problems + "\nmake rebase writes the carried series over patches/ and "
            "the pin; commit (or stash) first, on a branch of its own, so that "
            "`git checkout` can undo it"
        )


# ------------------------------------------------------------------- setup
def _target_tree(version: str, wheel: Path | None, tree: Path | None):
    """``(unpacked release tree, wheel or None)``."""
    if tree:
        if not (tree / "sglang").is_dir():
            raise ToolError(f"--tree {tree} has no sglang/ package")
        return tree, None
    wheel = wheel or drift.fetch(version, REBASE / "wheels")
    if not wheel.is_file():
        raise ToolError(f"--wheel {wheel} not found")
    print(
        f"{wheel.name}: sha256 {upstream.sha256_of(wheel)} (becomes the new pin "
        "once the series is carried)"
    )
    unpacked = drift.unpack(wheel, REBASE / "target")
    upstream.check_versions(upstream.Pin("sglang", version, {}), unpacked)
    return unpacked, wheel


def _replace_tree(repo: Path, tree: Path) -> None:
    """Make the work tree of ``repo`` exactly ``tree`` (not committed)."""
    git(repo, "rm", "-rq", "--cached", ".")
    for child in repo.iterdir():
        if child.name == ".git":
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    shutil.copytree(
        tree,
        repo,
        symlinks=True,
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns(upstream.STAMP, "__pycache__"),
    )
    git(repo, "add", "-A")


def start(version: str, wheel: Path | None, tree: Path | None, survey: bool):
    series = read_series()
    series_mod.check_series_files(series)
    if STATE.exists():
        raise ToolError(
            f"a rebase is in progress in {SRC}: finish it with `make "
            "rebase-continue` or drop it with `make rebase-abort`"
        )
    if not survey:
        _guard_outputs()
    pinned = upstream.load_pin()
    if version == pinned.version:
        raise ToolError(f"the series is already pinned to {version}")
    pinned_wheel, pristine = upstream.prepare()
    target, target_wheel = _target_tree(version, wheel, tree)
    if REBASE.exists():
        for stale in (SRC, OUT):
            if stale.exists():
                shutil.rmtree(stale)
    REBASE.mkdir(parents=True, exist_ok=True)
    series_mod.init_tree(pristine, pinned_wheel.name, SRC)
    failure = series_mod.apply_series(SRC, series)
    if failure:
        index, name, problems = failure
        raise ToolError(
            f"the series does not apply to its own pin ({name}, patch {index}):\n  "
            + "\n  ".join(problems)
            + "\nrun `make apply` and fix that first"
        )
    git(SRC, "tag", "series")
    commits = git(SRC, "rev-list", "--reverse", "upstream..series").split()
    git(SRC, "checkout", "-q", "-b", "carry", "upstream")
    _replace_tree(SRC, target)
    label = target_wheel.name if target_wheel else f"sglang {version} (tree)"
    git(SRC, "commit", "-q", "--allow-empty", "-m", f"upstream: {label}")
    git(SRC, "tag", "target")
    state = {
        "version": version,
        "survey": survey,
        "wheel": str(target_wheel) if target_wheel else None,
        "series": series,
        "commits": commits,
        "next": 0,
        "rows": [],
    }
    _save(state)
    _carry(state)


def _save(state: dict) -> None:
    STATE.write_text(json.dumps(state, indent=2))


# ------------------------------------------------------------------- carry
def _pick(commit: str) -> str:
    """Cherry-pick ``commit``: "ok", "empty" (nothing left to change) or
    "conflict" (stopped with the conflict in the work tree)."""
    before = git(SRC, "rev-parse", "HEAD").strip()
    out = git(SRC, "cherry-pick", commit, check=False)
    if git(SRC, "rev-parse", "-q", "--verify", "CHERRY_PICK_HEAD", check=False):
        if _conflicted() or git(SRC, "diff", "--cached", "--name-only").strip():
            return "conflict"
        git(SRC, "cherry-pick", "--skip")  # nothing left to change
        return "empty"
    if git(SRC, "rev-parse", "HEAD").strip() == before:
        raise ToolError(f"git cherry-pick {commit[:12]} did nothing:\n{out}")
    return "ok"


def _conflicted() -> list[str]:
    return git(SRC, "diff", "--name-only", "--diff-filter=U").split()


def _row(state: dict, index: int, status: str, files=()) -> None:
    state["rows"].append(
        {
            "order": index + 1,
            "patch": state["series"][index],
            "status": status,
            "files": list(files),
        }
    )


def _status_of_carried(name: str) -> str:
    exported = series_mod.export_commit(SRC, "HEAD")
    return "unchanged" if exported == (PATCHES / name).read_text() else "re-cut"


def _carry(state: dict) -> None:
    commits, series = state["commits"], state["series"]
    while state["next"] < len(commits):
        i = state["next"]
        result = _pick(commits[i])
        if result == "conflict":
            files = _conflicted()
            if state["survey"]:
                git(SRC, "cherry-pick", "--abort")
                _row(state, i, "conflict", files)
                state["next"] = i + 1
                _save(state)
                continue
            state["head"] = git(SRC, "rev-parse", "HEAD").strip()
            state["conflict_files"] = files
            _save(state)
            raise ToolError(
                f"patch {i + 1}/{len(series)} {series[i]} conflicts with sglang "
                f"{state['version']} in:\n  "
                + "\n  ".join(files)
                + f"\nresolve it in {SRC}: edit those files, `git add` them and "
                "`git cherry-pick --continue` (keep the subject: it names the "
                "patch), or `git cherry-pick --skip` to drop the patch; then "
                "`make rebase-continue`. `make rebase-abort` gives up (nothing "
                "outside build/rebase has changed)."
            )
        _row(
            state,
            i,
            "upstream" if result == "empty" else _status_of_carried(series[i]),
        )
        state["next"] = i + 1
        _save(state)
    _finish(state)


def resume() -> None:
    if not STATE.exists():
        raise ToolError(
            "no rebase in progress (start one with `make rebase VERSION=X`)"
        )
    state = json.loads(STATE.read_text())
    if git(SRC, "rev-parse", "-q", "--verify", "CHERRY_PICK_HEAD", check=False):
        raise ToolError(
            f"the cherry-pick in {SRC} is not finished: resolve the files, "
            "`git add` them and `git cherry-pick --continue` (or `--skip`)"
        )
    dirty = series_mod.uncommitted_changes(SRC)
    if dirty:
        raise ToolError(f"{SRC} has uncommitted changes:\n{dirty[:800]}")
    i = state["next"]
    head = git(SRC, "rev-parse", "HEAD").strip()
    if head == state.get("head"):
        _row(state, i, "dropped", state.get("conflict_files", ()))
    else:
        parents = git(SRC, "rev-list", f"{state['head']}..HEAD").split()
        if len(parents) != 1:
            raise ToolError(
                f"expected one commit for {state['series'][i]} on top of "
                f"{state['head'][:12]}, found {len(parents)}"
            )
        _row(state, i, "resolved", state.get("conflict_files", ()))
    state["next"] = i + 1
    state.pop("head", None)
    state.pop("conflict_files", None)
    _save(state)
    _carry(state)


def abort() -> None:
    if REBASE.exists():
        shutil.rmtree(REBASE)
    print(f"removed {REBASE}; patches/ and the pin are unchanged")


# ------------------------------------------------------------------ finish
def pin_text(version: str, wheel: Path) -> str:
    return (
        "# The SGLang release this patch series is pinned to: the official wheels on PyPI.\n"
        "# scripts/upstream.py refuses a wheel unless its name is listed below with its\n"
        "# sha256 and size. Written by `make rebase` from the wheel it carried the series\n"
        "# to; list the other platforms' wheels of the release before building there.\n"
        'name = "sglang"\n'
        f'version = "{version}"\n'
        "\n"
        f'[wheels."{wheel.name}"]\n'
        f'sha256 = "{upstream.sha256_of(wheel)}"\n'
        f"size = {wheel.stat().st_size}\n"
    )


def _series_text(series: list[str], kept: list[str]) -> str:
    lines = (PATCHES / "series").read_text().splitlines()
    out = []
    for line in lines:
        entry = line.split("#", 1)[0].strip()
        if entry and entry.split()[0] in series and entry.split()[0] not in kept:
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def _finish(state: dict) -> None:
    rows, series = state["rows"], state["series"]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    width = max(len(r["patch"]) for r in rows)
    print(f"\nseries onto sglang {state['version']} (git 3-way merge):")
    for r in rows:
        files = f"  ({', '.join(r['files'])})" if r["files"] else ""
        print(f"{r['order']:>3} {r['patch']:<{width}}  {r['status']}{files}")
    print(
        f"\n{len(rows)} patches: "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    )
    report = REBASE / f"rebase-{state['version']}.json"
    report.write_text(
        json.dumps(
            {"version": state["version"], "counts": counts, "patches": rows},
            indent=2,
        )
    )
    print(f"wrote {report}")
    if state["survey"]:
        STATE.unlink()
        return
    kept = [r["patch"] for r in rows if r["status"] not in ("upstream", "dropped")]
    carried = git(SRC, "rev-list", "--reverse", "target..HEAD").split()
    if len(carried) != len(kept):
        raise ToolError(
            f"{len(carried)} commits on target, {len(kept)} patches kept; "
            f"inspect {SRC}"
        )
    out_patches = OUT / "patches"
    for commit, name in zip(carried, kept):
        path = out_patches / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(series_mod.export_commit(SRC, commit))
    (out_patches / "series").write_text(_series_text(series, kept))
    pin = None
    if state["wheel"]:
        pin = OUT / "upstream" / "pin.toml"
        pin.parent.mkdir(parents=True, exist_ok=True)
        pin.write_text(pin_text(state["version"], Path(state["wheel"])))
    _guard_outputs()
    for name in series:
        if name not in kept:
            (PATCHES / name).unlink()
    for path in out_patches.rglob("*"):
        if path.is_file():
            dest = PATCHES / path.relative_to(out_patches)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
    if pin:
        shutil.copyfile(pin, PIN)
    STATE.unlink()
    print(
        f"wrote the carried series to {PATCHES}"
        + (f" and the pin for {state['version']} to {PIN}" if pin else "")
        + " (also in build/rebase/out/)"
        + (
            ""
            if pin
            else "; no wheel, so the pin is unchanged: pin the release by hand"
        )
        + ". Next: `make apply && make test`, then commit on this branch."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("version", nargs="?", help="the SGLang release, e.g. 0.5.22")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--wheel", type=Path, help="a local wheel of that release")
    src.add_argument("--tree", type=Path, help="an unpacked release tree")
    ap.add_argument("--survey", action="store_true", help="report only")
    ap.add_argument("--continue", dest="resume", action="store_true")
    ap.add_argument("--abort", action="store_true")
    args = ap.parse_args()
    if args.abort:
        abort()
    elif args.resume:
        resume()
    elif not args.version:
        ap.error("give the release to carry the series to, --continue or --abort")
    else:
        start(args.version, args.wheel, args.tree, args.survey)


if __name__ == "__main__":
    run_main(main)
