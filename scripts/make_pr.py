#!/usr/bin/env python3
"""Extract one feature group of the series as an upstream PR.

    python scripts/make_pr.py hicache-rank-shard     # make pr FEATURE=hicache-rank-shard

Writes build/pr/<feature>/:
  * NNNN-*.patch: the group's patches in upstream's repository layout
    (``python/sglang/...``), git-am-able, without this series' own
    Upstream-Status / Related / Remove-When fields;
  * tests/: the feature's registered tests (``pr_tests``: files under
    tests/registered declaring ``FEATURE_GROUP = "<feature>"`` and not
    ``PROJECT_ONLY``) laid out as upstream's ``test/registered/...``, with the
    test modules they import under ``python/sglang/test/``;
  * PR.md: a description in upstream's PR template built from the headers.
The patches are re-cut against the pinned wheel alone (``carry_alone``: a
group that needs another group's lines is refused), or stacked on the fixes
its series block names (``# needs: fixes/NNNN-...``, written to stacked-on/) and checked with
``patch -p1 --fuzz=0`` alone on the pristine wheel laid out under ``python/``.
``pr_check.py`` then runs the tests there as upstream's CI does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import series as series_mod
from common import BUILD, PATCHES, ToolError, git, group_needs, read_series, run_main
from headers import SERIES_FIELDS, patch_header
from lint_product import format_files
from pr_bench import NO_RESULTS, benchmark_section
from pr_tests import extract

import upstream

# A field runs on over its continuation lines (indented or not) up to a blank
# line, the next field, or the diff.
_DROP_FIELDS = re.compile(
    r"(?m)^(" + "|".join(SERIES_FIELDS) + r"):.*\n"
    r"(?:(?![\w-]+:\s)(?!diff --git )(?!---).+\n)*"
)


# Where make pr puts the patches of other groups the PR is stacked on.
STACKED_ON = "stacked-on"


def to_upstream_layout(text: str, author: str | None = None) -> str:
    text = _DROP_FIELDS.sub("", text)
    if author:
        text = re.sub(r"(?m)^From: .*$", lambda _: f"From: {author}", text, count=1)
    text = re.sub(
        r"(?m)^(diff --git a/)sglang/(\S+) b/sglang/",
        r"\1python/sglang/\2 b/python/sglang/",
        text,
    )
    text = re.sub(r"(?m)^(---|\+\+\+) ([ab])/sglang/", r"\1 \2/python/sglang/", text)
    return text


def make_pr(feature: str, author: str | None = None) -> Path:
    entries = [e for e in read_series() if e.startswith(feature + "/")]
    if not entries:
        groups = sorted({e.split("/")[0] for e in read_series()})
        raise ToolError(
            f"no patches for feature {feature!r}; groups: {', '.join(groups)}"
        )
    out = BUILD / "pr" / feature
    if out.exists():
        shutil.rmtree(out)
    (out / "tests").mkdir(parents=True)
    motivation, modifications, related = [], [], []
    needs = group_needs(feature)
    alone = carry_alone(needs + entries)
    if needs:
        # The fixes this group is stacked on, as their own PR extracts them.
        (out / STACKED_ON).mkdir()
        for name in needs:
            text = to_upstream_layout(alone[name], author)
            (out / STACKED_ON / Path(name).name).write_text(text)
            subject = patch_header((PATCHES / name).read_text())["Subject"]
            motivation.append(
                f"- Stacked on {subject} (`{name}`, `make pr "
                f"FEATURE={name.split('/')[0]}`): apply that PR first."
            )
    for name in entries:
        text = to_upstream_layout(alone[name], author)
        (out / Path(name).name).write_text(text)
        header = patch_header((PATCHES / name).read_text())
        subject = header["Subject"]
        motivation.append(f"- {subject}: {' '.join(header.get('Why', '').split())}")
        modifications.append(f"- {subject}: {' '.join(header.get('How', '').split())}")
        if header.get("Related"):
            related.append(f"- {subject}: {' '.join(header['Related'].split())}")
    extraction = extract(feature)
    for rel, text in extraction.files.items():
        dest = out / "tests" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    _format(out / "tests", extraction.files)
    tests = extraction.tests
    support = sorted(set(extraction.files) - set(tests))
    bench = benchmark_section(feature)
    # ticked only where the section above holds results
    bench_box = "[ ]" if bench == NO_RESULTS else "[x]"
    (out / "PR.md").write_text(
        "## Motivation\n\n" + "\n".join(motivation) + "\n\n"
        "## Modifications\n\n" + "\n".join(modifications) + "\n\n"
        "Related:\n\n" + "\n".join(related) + "\n\n"
        "## Accuracy Tests\n\n"
        + "\n".join(f"- `{t}`" for t in tests)
        + "\n\n"
        + (
            "Test utilities and CPU stand-ins added with the tests: "
            + ", ".join(f"`{f}`" for f in support)
            + ".\n\n"
            if support
            else ""
        )
        + "Run each as CPU CI does: `python3 test_<name>.py` in its folder.\n\n"
        "## Benchmarking and Profiling\n\n" + bench + "\n"
        "## Checklist\n\n"
        "- [x] Format your code with pre-commit (isort, ruff, ruff format, codespell)\n"
        "- [x] Add unit tests (above)\n"
        "- [ ] Update documentation (server arguments / environment variables)\n"
        f"- {bench_box} Provide accuracy and speed benchmark results (above)\n"
        "- [x] Follow the SGLang code style guidance\n"
    )
    _check(out, entries, needs)
    print(f"wrote {out} ({len(entries)} patches, {len(tests)} test files)")
    return out


def _format(root: Path, files) -> None:
    """Upstream's isort and ruff format (scripts/lint_product.py) over the
    extracted test files: renamed imports move into upstream's order."""
    format_files(root, sorted(files))


def carry_alone(entries: list[str]) -> dict[str, str]:
    """The group's patches re-cut against the pristine wheel alone: the whole
    series is committed onto pristine (as ``make apply`` does), then the
    group's commits are cherry-picked onto pristine in order (git's 3-way
    merge). A conflict means the group uses lines of an earlier group
    (refused, naming the patch); otherwise the exported patches apply to
    pristine 0.5.23 at zero fuzz and zero offset by construction."""
    wheel, pristine = upstream.prepare()
    series = read_series()
    with tempfile.TemporaryDirectory(dir=BUILD) as tmp:
        repo = Path(tmp) / "src"
        series_mod.init_tree(pristine, wheel.name, repo)
        failure = series_mod.apply_series(repo, series)
        if failure:
            index, name, problems = failure
            raise ToolError(
                f"the series does not apply ({name}):\n  " + "\n  ".join(problems)
            )
        commits = dict(
            zip(series, git(repo, "rev-list", "--reverse", "upstream..HEAD").split())
        )
        git(repo, "checkout", "-q", "-b", "alone", "upstream")
        out = {}
        for name in entries:
            git(repo, "cherry-pick", commits[name], check=False)
            if git(
                repo, "rev-parse", "-q", "--verify", "CHERRY_PICK_HEAD", check=False
            ):
                files = git(repo, "diff", "--name-only", "--diff-filter=U").split()
                raise ToolError(
                    f"patches/{name} does not apply without the groups before it "
                    f"(git's merge conflicts in {', '.join(files) or 'the tree'}): "
                    "it uses lines another group adds; re-cut it so that each "
                    "group stands alone on the pinned release"
                )
            out[name] = series_mod.export_commit(repo, "HEAD")
    return out


def _check(out: Path, entries: list[str], needs: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lay_out(out, entries, Path(tmp), needs)


def lay_out(out: Path, entries: list[str], repo: Path, needs=()) -> None:
    """``patch -p1 --fuzz=0`` the extracted patches, alone (on the patches
    the group is stacked on), onto the pristine wheel laid out under
    ``repo/python``: every hunk at its recorded line."""
    copy_pristine(repo)
    apply_stacked_on(out, needs, repo)
    apply_each(out, entries, repo)


def apply_stacked_on(out: Path, needs, repo: Path) -> None:
    """The patches of other groups this PR is stacked on (``# needs:``)."""
    for name in needs:
        _apply(repo, out / STACKED_ON / Path(name).name, name)


def copy_pristine(repo: Path) -> None:
    _, pristine = upstream.prepare()
    shutil.copytree(pristine / "sglang", repo / "python" / "sglang", symlinks=True)


def apply_each(out: Path, entries: list[str], repo: Path, after_each=None) -> None:
    """Apply the extracted patches in order; ``after_each(name, patches so
    far)`` runs once each one is applied."""
    applied = []
    for name in entries:
        _apply(repo, out / Path(name).name, name)
        applied.append(out / Path(name).name)
        if after_each is not None:
            after_each(name, applied)


def _apply(repo: Path, patch: Path, name: str) -> None:
    proc = subprocess.run(
        ["patch", "-p1", "--fuzz=0", "--batch", "--forward", "-i", str(patch)],
        cwd=repo,
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C"},
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 or series_mod.unclean(output):
        raise ToolError(
            f"{name} does not apply alone to the pinned release in the upstream "
            f"layout at zero fuzz and offset:\n{output}"
        )


def main() -> None:
    if len(sys.argv) != 2:
        raise ToolError("usage: make_pr.py <feature group>  (author: $PR_AUTHOR)")
    author = os.environ.get("PR_AUTHOR") or None
    if author and not re.fullmatch(r"[^<>\n]+ <[^<>@\s]+@[^<>\s]+>", author):
        raise ToolError(
            f"PR_AUTHOR={author!r}: give it as 'Name <email>' (the extracted "
            "patches' From: line)"
        )
    make_pr(sys.argv[1], author)


if __name__ == "__main__":
    run_main(main)
