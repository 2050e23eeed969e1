"""Shared paths, errors and git helpers for the patch-series tooling."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("SGL_BUILD_DIR", ROOT / "build"))
PATCHES = Path(os.environ.get("SGL_PATCHES_DIR", ROOT / "patches"))
PIN = Path(os.environ.get("SGL_PIN_FILE", ROOT / "upstream" / "pin.toml"))
# Download cache and unpacked pristine trees; shareable between build dirs.
CACHE = Path(os.environ.get("SGL_CACHE_DIR", BUILD / "cache"))
UPSTREAM_TREES = Path(os.environ.get("SGL_UPSTREAM_DIR", BUILD / "upstream"))

# Fixed identity and date: commits in build/src and exported patches must not
# depend on who ran the tooling or when.
PATCH_AUTHOR = "SGLang patch series <sglang-patches@users.noreply.github.com>"
PATCH_DATE = "Thu, 1 Jan 2026 00:00:00 +0000"
UPSTREAM_TAG = "upstream"


class ToolError(Exception):
    """A refusal with a message meant for the user; exits with status 2."""


def git_env() -> dict:
    """An environment that makes git ignore the user's and the system's config."""
    env = dict(os.environ)
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="SGLang patch series",
        GIT_AUTHOR_EMAIL="sglang-patches@users.noreply.github.com",
        GIT_COMMITTER_NAME="SGLang patch series",
        GIT_COMMITTER_EMAIL="sglang-patches@users.noreply.github.com",
        GIT_AUTHOR_DATE=PATCH_DATE,
        GIT_COMMITTER_DATE=PATCH_DATE,
        LC_ALL="C",
        TZ="UTC",
        # No background auto-gc: it repacks .git/objects while apply moves or
        # removes the tree (FileNotFoundError on an object directory).
        GIT_CONFIG_COUNT="2",
        GIT_CONFIG_KEY_0="gc.auto",
        GIT_CONFIG_VALUE_0="0",
        GIT_CONFIG_KEY_1="maintenance.auto",
        GIT_CONFIG_VALUE_1="false",
    )
    return env


def git(repo: Path, *args: str, check: bool = True, env: dict | None = None) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        env=env or git_env(),
    )
    if check and proc.returncode != 0:
        raise ToolError(
            f"git {' '.join(args)} failed in {repo}:\n{proc.stderr.strip()}"
        )
    return proc.stdout


def read_series(series_file: Path | None = None) -> list[str]:
    """Patch paths of a quilt series file, in order (comments and blanks dropped)."""
    series_file = series_file or PATCHES / "series"
    if not series_file.is_file():
        raise ToolError(f"missing series file: {series_file}")
    entries = []
    for line in series_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split()[0]
        if name.startswith("/") or ".." in Path(name).parts:
            raise ToolError(f"series entry must be a path inside patches/: {name}")
        entries.append(name)
    return entries


def group_needs(feature: str, series_file: Path | None = None) -> list[str]:
    """The patches of other groups that ``feature`` is stacked on: the
    ``# needs: <entry> ...`` comment lines of its ``# == <feature>: ...``
    block in the series file (upstream fixes a feature builds on)."""
    series_file = series_file or PATCHES / "series"
    needs, inside = [], False
    for line in series_file.read_text().splitlines():
        if line.startswith("# == "):
            inside = line[len("# == ") :].split(":", 1)[0].strip() == feature
        elif inside and line.startswith("# needs:"):
            needs += line[len("# needs:") :].split()
    series = read_series(series_file)
    for name in needs:
        if name not in series or name.startswith(feature + "/"):
            raise ToolError(
                f"series: group {feature} needs {name}, which is not a patch of "
                "another group in the series"
            )
    return needs


def run_main(main) -> None:
    try:
        main()
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
