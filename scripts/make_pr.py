#!/usr/bin/env python3
"""Extract one feature group of the series as an upstream PR.

    python scripts/make_pr.py hicache-rank-shard     # make pr FEATURE=hicache-rank-shard

Writes build/pr/<feature>/:
  * NNNN-*.patch: the group's patches in upstream's repository layout
    (``python/sglang/...``), git-am-able, without this series' own
    Upstream-Status / Related / Remove-When fields;
  * tests/: the feature's registered tests (files under tests/registered whose
    module docstring or name mentions the feature's test prefix, see
    FEATURE_TESTS) laid out as upstream's ``test/registered/...``;
  * PR.md: a description in upstream's PR template built from the headers.
The rewritten patches are checked with ``git apply --check`` against the
pristine wheel laid out under ``python/``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    BUILD,
    PATCHES,
    ROOT,
    ToolError,
    git_env,
    read_series,
    run_main,
)
from headers import patch_header  # noqa: E402
from pr_bench import benchmark_section  # noqa: E402

import upstream  # noqa: E402

# Registered test files of each feature (globs under tests/registered).
FEATURE_TESTS = {
    "hicache-rank-shard": [
        "**/test_hicache_rank_shard*.py",
        "**/test_l2_transfer_load_layer.py",
    ],
    "cache-aware-routing": ["**/test_*cache_aware*.py", "**/test_*prefix_digest*.py"],
    "decode-hicache": ["**/test_*decode_hicache*.py"],
}
# A field runs on over its continuation lines (indented or not) up to a blank
# line, the next field, or the diff.
_DROP_FIELDS = re.compile(
    r"(?m)^(Upstream-Status|Related|Remove-When):.*\n"
    r"(?:(?![\w-]+:\s)(?!diff --git )(?!---).+\n)*"
)


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
    for name in entries:
        text = to_upstream_layout((PATCHES / name).read_text(), author)
        (out / Path(name).name).write_text(text)
        header = patch_header((PATCHES / name).read_text())
        subject = header["Subject"]
        motivation.append(f"- {subject}: {' '.join(header.get('Why', '').split())}")
        modifications.append(f"- {subject}: {' '.join(header.get('How', '').split())}")
        if header.get("Related"):
            related.append(f"- {subject}: {' '.join(header['Related'].split())}")
    tests = []
    for pattern in FEATURE_TESTS.get(feature, []):
        for path in sorted((ROOT / "tests" / "registered").glob(pattern)):
            rel = path.relative_to(ROOT / "tests" / "registered")
            dest = out / "tests" / "test" / "registered" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, dest)
            tests.append(f"test/registered/{rel}")
    support = out / "tests" / "support"
    for helper in ("harness", "standins"):
        shutil.copytree(
            ROOT / "tests" / helper,
            support / helper,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    (out / "PR.md").write_text(
        "## Motivation\n\n" + "\n".join(motivation) + "\n\n"
        "## Modifications\n\n" + "\n".join(modifications) + "\n\n"
        "Related:\n\n" + "\n".join(related) + "\n\n"
        "## Accuracy Tests\n\n" + "\n".join(f"- `{t}`" for t in tests) + "\n\n"
        "The tests use this series' CPU harness and test-only stand-ins "
        "(tests/support/: `harness`, `standins`); upstreaming moves them under "
        "`python/sglang/test/`.\n\n"
        "## Benchmarking and Profiling\n\n" + benchmark_section(feature) + "\n"
        "## Checklist\n\n"
        "- [x] Format your code with pre-commit (black, isort, ruff, codespell)\n"
        "- [x] Add unit tests (above)\n"
        "- [ ] Update documentation (server arguments / environment variables)\n"
        "- [x] Provide accuracy and speed benchmark results (above)\n"
        "- [x] Follow the SGLang code style guidance\n"
    )
    _check(out, entries)
    print(f"wrote {out} ({len(entries)} patches, {len(tests)} test files)")
    return out


def _check(out: Path, entries: list[str]) -> None:
    """git apply the rewritten series (and the groups before it) on the
    pristine wheel laid out under python/."""
    _, pristine = upstream.prepare()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        shutil.copytree(pristine / "sglang", repo / "python" / "sglang", symlinks=True)
        for name in read_series():
            if name in entries:
                break
            patch = to_upstream_layout((PATCHES / name).read_text())
            _apply(repo, patch, name)
        for name in entries:
            _apply(repo, (out / Path(name).name).read_text(), name)


def _apply(repo: Path, patch: str, name: str) -> None:
    args = ["git", "apply", "--whitespace=nowarn", "-"]
    proc = subprocess.run(
        args, cwd=repo, input=patch, capture_output=True, text=True, env=git_env()
    )
    if proc.returncode != 0:
        raise ToolError(f"{name} does not apply in the upstream layout:\n{proc.stderr}")


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
