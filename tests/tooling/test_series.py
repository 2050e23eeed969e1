"""apply / refresh: strict, atomic, byte-for-byte round trip; patch and quilt agree."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT, import_scripts, run_script

GIT_ENV = {"GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "-c",
            "gc.auto=0",
            *args,
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **GIT_ENV},
    ).stdout


def series_entries(patches: Path) -> list[str]:
    return [
        l.split("#")[0].strip()
        for l in (patches / "series").read_text().splitlines()
        if l.split("#")[0].strip()
    ]


def snapshot(patches: Path) -> dict:
    return {
        p.relative_to(patches): p.read_bytes()
        for p in patches.rglob("*")
        if p.is_file()
    }


def apply(env, *args):
    return run_script("series.py", "apply", *args, env=env)


def test_apply_then_refresh_is_byte_identical(sandbox):
    tmp, env = sandbox
    before = snapshot(tmp / "patches")
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    n = len(series_entries(tmp / "patches"))
    assert len(git(src, "rev-list", "upstream..HEAD").split()) == n >= 1
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "no changes" in proc.stdout
    assert snapshot(tmp / "patches") == before
    # and the committed patches equal what refresh exports from the real tree
    assert before == snapshot(ROOT / "patches")


def test_applied_tree_never_starts_git_gc_on_its_own(sandbox):
    # A user's own git commands in build/src read the tree's config.
    tmp, env = sandbox
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    local = ["git", "-C", str(src), "config", "--local", "--get"]
    assert (
        subprocess.run(local + ["gc.auto"], capture_output=True, text=True).stdout
        == "0\n"
    )
    assert (
        subprocess.run(
            local + ["maintenance.auto"], capture_output=True, text=True
        ).stdout
        == "false\n"
    )


def _add_commit(src: Path, rel: str, old: str, new: str, subject: str) -> None:
    path = src / rel
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    git(src, "commit", "-qam", f"{subject}\n\nWhy: test.\n")


def test_refresh_exports_a_new_commit_into_its_group(sandbox):
    tmp, env = sandbox
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    _add_commit(
        src,
        "sglang/srt/mem_cache/l2_transfer.py",
        '"""Runs resolved',
        '"""Run resolved',
        "[HiCache] Test docstring",
    )
    proc = run_script(
        "series.py", "refresh", env={**env, "GROUP": "hicache-rank-shard"}
    )
    assert proc.returncode == 0, proc.stderr
    entries = series_entries(tmp / "patches")
    number = len([e for e in entries if e.startswith("hicache-rank-shard/")])
    assert entries[-1].startswith(f"hicache-rank-shard/{number:04d}-test-docstring")
    text = (tmp / "patches" / entries[-1]).read_text()
    assert "Subject: [PATCH] [HiCache] Test docstring" in text
    assert "Date: Thu, 1 Jan 2026 00:00:00 +0000" in text
    # applying the refreshed series reproduces it byte for byte
    before = snapshot(tmp / "patches")
    assert apply(env).returncode == 0
    assert run_script("series.py", "refresh", env=env).returncode == 0
    assert snapshot(tmp / "patches") == before


def test_refresh_writes_one_from_line_for_a_long_author(sandbox):
    """format-patch folds a long From header; the fixed author replaces all
    of it (a continuation line left behind would become part of the name)."""
    tmp, env = sandbox
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    path = src / "sglang/srt/mem_cache/l2_transfer.py"
    path.write_text(path.read_text().replace('"""Runs resolved', '"""Run resolved', 1))
    long_author = (
        "-c",
        "user.name=Maintainers of a fork",
        "-c",
        "user.email=maintainers@users.noreply.a-long-mail-domain.example",
    )
    git(src, *long_author, "commit", "-qam", "[HiCache] Long author")
    proc = run_script(
        "series.py", "refresh", env={**env, "GROUP": "hicache-rank-shard"}
    )
    assert proc.returncode == 0, proc.stderr
    text = (tmp / "patches" / series_entries(tmp / "patches")[-1]).read_text()
    head = text.split("Subject: ")[0].splitlines()
    assert head[1:] == [
        "From: SGLang patch series <sglang-patches@users.noreply.github.com>",
        "Date: Thu, 1 Jan 2026 00:00:00 +0000",
    ], head


def test_broken_patch_named_with_hunk_and_no_half_tree(sandbox):
    tmp, env = sandbox
    patches = tmp / "patches"
    # A second patch touching two files: the first hunk applies, the second not.
    bad = patches / "hicache-rank-shard" / "0099-broken.patch"
    bad.write_text(
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: t <t@t>\nDate: Thu, 1 Jan 2026 00:00:00 +0000\n"
        "Subject: [PATCH] broken\n\n---\n"
        "diff --git a/sglang/version.py b/sglang/version.py\n"
        "--- a/sglang/_version.py\n+++ b/sglang/_version.py\n"
        "@@ -1,3 +1,3 @@\n-# file generated by vcs-versioning\n+# file generated by X\n"
        " # don't change, don't track in version control\n from __future__ import annotations\n"
        "diff --git a/sglang/srt/mem_cache/l2_transfer.py b/sglang/srt/mem_cache/l2_transfer.py\n"
        "--- a/sglang/srt/mem_cache/l2_transfer.py\n+++ b/sglang/srt/mem_cache/l2_transfer.py\n"
        "@@ -1,3 +1,3 @@ context\n-this line is not there\n+x\n import logging\n"
        " from contextlib import contextmanager\n"
    )
    with open(patches / "series", "a") as f:
        f.write("hicache-rank-shard/0099-broken.patch\n")
    proc = apply(env)
    assert proc.returncode == 2
    err = proc.stderr
    assert "hicache-rank-shard/0099-broken.patch" in err
    assert (
        "sglang/srt/mem_cache/l2_transfer.py hunk #1 (@@ -1,3 +1,3 @@ context)" in err
    )
    assert "FAILED" in err
    src = tmp / "build" / "src"
    # last good state: upstream + the first patch, clean, nothing of the broken one
    assert git(src, "status", "--porcelain") == ""
    last_good = series_entries(patches)[-2]  # the entry before the broken one
    subject = git(src, "log", "--format=%s", "-1").strip()
    assert f"Subject: [PATCH] {subject[:20]}" in (patches / last_good).read_text()
    assert "vcs-versioning" in (src / "sglang/_version.py").read_text()
    assert not (tmp / "build" / "src.tmp").exists()
    good = len(series_entries(patches)) - 1  # every patch before the broken one
    assert len(git(src, "rev-list", "upstream..HEAD").split()) == good


def test_offset_is_refused(sandbox):
    tmp, env = sandbox
    patches = tmp / "patches"
    name = series_entries(patches)[0]
    text = (patches / name).read_text()
    # Move the first hunk's recorded position by two lines: it would apply
    # with offset.
    hunk = re.search(r"(?m)^@@ -(\d+),(\d+) \+(\d+),(\d+) @@", text)
    moved = f"@@ -{int(hunk[1]) + 2},{hunk[2]} +{int(hunk[3]) + 2},{hunk[4]} @@"
    shifted = text.replace(hunk[0], moved, 1)
    assert shifted != text
    (patches / name).write_text(shifted)
    proc = apply(env)
    assert proc.returncode == 2
    assert "offset" in proc.stderr and name in proc.stderr
    assert f"hunk #1 ({moved}" in proc.stderr


def test_apply_refuses_to_discard_unexported_work(sandbox):
    tmp, env = sandbox
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    (src / "sglang" / "new_file.py").write_text("x = 1\n")
    proc = apply(env)
    assert proc.returncode == 2 and "uncommitted changes" in proc.stderr
    git(src, "add", "-A")
    git(src, "commit", "-qm", "work")
    proc = apply(env)
    assert proc.returncode == 2 and "make refresh" in proc.stderr
    assert (src / "sglang" / "new_file.py").exists()
    assert apply(env, "--force").returncode == 0
    assert not (src / "sglang" / "new_file.py").exists()


def test_refresh_refuses_dirty_tree_and_bad_layout(sandbox):
    tmp, env = sandbox
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    target = src / "sglang" / "srt" / "mem_cache" / "l2_transfer.py"
    target.write_text(target.read_text() + "\n# dirty\n")
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 2 and "uncommitted changes" in proc.stderr
    git(src, "checkout", "--", ".")
    git(src, "tag", "-d", "upstream")
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 2 and "no 'upstream' tag" in proc.stderr
    git(src, "tag", "upstream", git(src, "rev-list", "--max-parents=0", "HEAD").strip())
    git(src, "checkout", "-q", "-b", "side", "upstream")
    git(src, "commit", "-q", "--allow-empty", "-m", "side")
    git(src, "checkout", "-q", "main")
    git(src, "merge", "-q", "--no-ff", "--no-edit", "side")
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 2 and "unexpected commit layout" in proc.stderr
    assert "merge commit" in proc.stderr


def test_plain_patch_and_quilt_give_the_same_tree(sandbox):
    assert shutil.which("quilt"), "quilt is required (apt-get install quilt)"
    tmp, env = sandbox
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    pristine = next((ROOT / "build" / "upstream").glob("sglang-0.5.23-*"))
    changed = git(src, "diff", "--name-only", "upstream", "HEAD").split()
    assert changed
    for tool in ("patch", "quilt"):
        tree = tmp / tool
        shutil.copytree(pristine, tree, symlinks=True)
        proc = run_script("series.py", f"check-{tool}", str(tree), env=env)
        assert proc.returncode == 0, proc.stderr
        for rel in changed:
            assert (tree / rel).read_bytes() == (src / rel).read_bytes(), (tool, rel)


def test_make_pr_rewrites_to_upstream_layout(sandbox):
    tmp, env = sandbox
    proc = run_script("make_pr.py", "hicache-rank-shard", env=env)
    assert proc.returncode == 0, proc.stderr
    out = tmp / "build" / "pr" / "hicache-rank-shard"
    patches = sorted(out.glob("*.patch"))
    assert len(patches) == len(
        [
            e
            for e in series_entries(tmp / "patches")
            if e.startswith("hicache-rank-shard/")
        ]
    )
    for p in patches:
        text = p.read_text()
        assert "diff --git a/python/sglang/" in text
        assert "\n--- a/sglang/" not in text and "Remove-When:" not in text
    assert "## Motivation" in (out / "PR.md").read_text()
    assert list((out / "tests" / "test" / "registered").rglob("test_*.py"))
    proc = run_script("make_pr.py", "no-such-feature", env=env)
    assert proc.returncode == 2 and "groups: " in proc.stderr
    assert "hicache-rank-shard" in proc.stderr.split("groups: ")[1]


def test_make_pr_drops_header_fields_with_their_continuation_lines():
    (make_pr,) = import_scripts("make_pr")
    text = (
        "Subject: [PATCH] x\n\nWhy: because.\nHow: so.\n"
        "Upstream-Status: not yet submitted; relates to\n"
        "sgl-project/sglang#1 (unindented continuation)\n"
        "Remove-When: upstream ships it\n"
        "  (indented continuation).\n"
        "\n"
        "diff --git a/sglang/a.py b/sglang/a.py\n"
        "--- a/sglang/a.py\n+++ b/sglang/a.py\n"
    )
    out = make_pr.to_upstream_layout(text)
    assert "How: so.\n\ndiff --git a/python/sglang/a.py b/python/sglang/a.py\n" in out
    for gone in ("Upstream-Status", "continuation", "Remove-When", "sglang#1"):
        assert gone not in out


def _rebase_todo(src: Path, script: str) -> None:
    """``git rebase -i upstream`` with ``script`` (python, reads/writes the todo
    file given as sys.argv[1]) as the sequence editor."""
    editor = src.parent / "seq_editor.py"
    editor.write_text(script)
    proc = subprocess.run(
        [
            "git",
            "-C",
            str(src),
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "rebase",
            "-q",
            "-i",
            "upstream",
        ],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            **GIT_ENV,
            "GIT_SEQUENCE_EDITOR": f"{sys.executable} {editor}",
        },
    )
    assert proc.returncode == 0, proc.stderr


# Swaps the picks at indices {a} and {b} (two independent commits: the last
# rank-shard patch and the first routing patch, which touch different files).
SWAP = """import sys
path = sys.argv[1]
lines = open(path).read().splitlines(True)
picks = [i for i, l in enumerate(lines) if l.startswith("pick ")]
a, b = picks[{a}], picks[{b}]
lines[a], lines[b] = lines[b], lines[a]
open(path, "w").writelines(lines)
"""


def test_refresh_follows_reordered_commits(sandbox):
    # Two independent commits swapped (the README's rebase workflow): each
    # patch file keeps its own commit, the series takes the commit order.
    tmp, env = sandbox
    patches = tmp / "patches"
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    entries = series_entries(patches)
    before = snapshot(patches)
    b = next(i for i, e in enumerate(entries) if e.startswith("cache-aware-routing/"))
    a = b - 1
    assert entries[a].startswith("hicache-rank-shard/")
    _rebase_todo(src, SWAP.format(a=a, b=b))
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "reordered" in proc.stdout
    after = series_entries(patches)
    swapped = entries[:a] + [entries[b], entries[a]] + entries[b + 1 :]
    assert after == swapped
    for name in entries:  # every file still holds its own commit, byte for byte
        assert (patches / name).read_bytes() == before[Path(name)], name
    # and the reordered series applies and round-trips
    assert apply(env).returncode == 0
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 0 and "no changes" in proc.stdout, proc.stdout


def test_refresh_matches_a_reworded_commit_by_content(sandbox):
    tmp, env = sandbox
    patches = tmp / "patches"
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    entries = series_entries(patches)
    git(src, "commit", "-q", "--amend", "-m", "[HiCache] Reworded subject\n\nWhy: t.\n")
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 0, proc.stderr
    assert series_entries(patches) == entries
    assert "Subject: [PATCH] [HiCache] Reworded subject" in (
        (patches / entries[-1]).read_text()
    )


def test_refresh_refuses_dropped_and_ambiguous_commits(sandbox):
    tmp, env = sandbox
    patches = tmp / "patches"
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    before = snapshot(patches)
    head = git(src, "rev-parse", "HEAD").strip()
    # Reworded and changed at once: matches no patch by subject or content.
    target = src / "sglang" / "srt" / "mem_cache" / "l2_transfer.py"
    target.write_text(target.read_text() + "\n# changed\n")
    git(src, "commit", "-q", "-a", "--amend", "-m", "[PD] Something else\n")
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 2
    last = series_entries(patches)[-1]
    assert f"patches/{last}" in proc.stderr and "by subject or by content" in (
        proc.stderr
    )
    assert snapshot(patches) == before  # nothing written
    # A dropped commit is named too.
    git(src, "reset", "-q", "--hard", f"{head}~1")
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 2 and f"patches/{last}" in proc.stderr
    # Two commits with one subject.
    git(src, "reset", "-q", "--hard", head)
    subject = git(src, "log", "-1", "--format=%s", "HEAD~1").strip()
    git(src, "commit", "-q", "--allow-empty", "-m", subject)
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 2 and "same subject" in proc.stderr
    assert snapshot(patches) == before


def test_missing_patch_file_reported_before_applying(sandbox):
    tmp, env = sandbox
    patches = tmp / "patches"
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    head = git(src, "rev-parse", "HEAD").strip()
    name = series_entries(patches)[-1]
    (patches / name).rename(patches / (name + ".moved"))
    proc = apply(env, "--force")
    assert proc.returncode == 2
    assert f"patches/{name}" in proc.stderr and "do not exist" in proc.stderr
    assert "applied" not in proc.stdout
    assert git(src, "rev-parse", "HEAD").strip() == head  # tree untouched
    proc = run_script("series.py", "refresh", env=env)
    assert proc.returncode == 2 and f"patches/{name}" in proc.stderr


SWAP_IN_FAILS = """
import os, shutil, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import series

real = shutil.rmtree
calls = []

def flaky_rmtree(path, ignore_errors=False, **kw):
    # Remove half of the tree, then fail (as a concurrent `git gc` did).
    calls.append(str(path))
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    for p in files[: len(files) // 2]:
        p.unlink()
    if not ignore_errors:
        raise FileNotFoundError(str(path))
    real(path, ignore_errors=True)

shutil.rmtree = flaky_rmtree
series.apply(force=True)
print("removed:", calls)
"""


def test_apply_moves_the_old_tree_aside_before_removing_it(sandbox):
    tmp, env = sandbox
    assert apply(env).returncode == 0
    src = tmp / "build" / "src"
    n = len(git(src, "rev-list", "upstream..HEAD").split())
    proc = subprocess.run(
        [sys.executable, "-c", SWAP_IN_FAILS, str(ROOT / "scripts")],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    assert "src.old" in proc.stdout  # only the moved-aside tree was removed
    assert git(src, "status", "--porcelain") == ""
    assert len(git(src, "rev-list", "upstream..HEAD").split()) == n
    assert not (tmp / "build" / "src.old").exists()
    assert not (tmp / "build" / "src.tmp").exists()
    # The upstream commit is packed: no thousands of loose objects for a
    # user's commit to trip `git gc --auto` over.
    counts = dict(
        line.split(": ")
        for line in git(src, "count-objects", "-v").splitlines()
        if ": " in line
    )
    # Loose objects are the series commits' own (a few per patch), the
    # upstream commit's objects (thousands) are in the pack.
    upstream_objects = len(git(src, "rev-list", "--objects", "upstream").splitlines())
    assert int(counts["in-pack"]) >= upstream_objects, (counts, upstream_objects)
    assert int(counts["count"]) < upstream_objects // 10, (counts, upstream_objects)
