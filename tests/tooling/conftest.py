"""Fixtures for the tooling tests: isolated build/patches dirs sharing the
real download cache and unpacked upstream tree (never the real build/src)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def import_scripts(*names: str) -> list:
    """The scripts ``names`` as modules. They import each other by file name
    (``python3 scripts/x.py`` has scripts/ first on its path); scripts/ is on
    the path only while they are imported."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(SCRIPTS))


def run_script(script: str, *args: str, env: dict, check: bool = False):
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def upstream_wheel() -> Path:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "upstream.py"), "wheel-path"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(proc.stdout.strip())


def sandbox_env(tmp: Path, upstream_wheel: Path) -> dict:
    """A copy of patches/ under ``tmp`` and a fresh build dir there; the
    scripts' environment for them."""
    shutil.copytree(ROOT / "patches", tmp / "patches")
    return {
        "SGL_BUILD_DIR": str(tmp / "build"),
        "SGL_PATCHES_DIR": str(tmp / "patches"),
        "SGL_DIST_DIR": str(tmp / "dist"),
        "SGL_CACHE_DIR": str(upstream_wheel.parent),
        "SGL_UPSTREAM_DIR": str(ROOT / "build" / "upstream"),
    }


@pytest.fixture
def sandbox(tmp_path, upstream_wheel):
    """A copy of patches/ and a fresh build dir; env for the scripts."""
    return tmp_path, sandbox_env(tmp_path, upstream_wheel)


# The author ``built_prs`` gives the extracted patches.
PR_AUTHOR = "Jane Doe <jane@example.com>"


class BuiltPRs:
    """``built_prs(group)``: build/pr/<group> made by ``make_pr.py <group>``
    once per session (on first use), in one sandbox, ``PR_AUTHOR`` set."""

    def __init__(self, tmp: Path, env: dict):
        self.tmp, self.env, self.procs = tmp, env, {}

    def __call__(self, group: str) -> Path:
        if group not in self.procs:
            self.procs[group] = run_script("make_pr.py", group, env=self.env)
        proc = self.procs[group]
        assert proc.returncode == 0, proc.stderr
        return self.tmp / "build" / "pr" / group


@pytest.fixture(scope="session")
def built_prs(tmp_path_factory, upstream_wheel):
    """The groups' PRs, each extracted once per session, for the tests that
    only read what make_pr writes; a test that changes patches/ or the build
    makes its own (``sandbox``)."""
    tmp = tmp_path_factory.mktemp("built-prs")
    return BuiltPRs(tmp, {**sandbox_env(tmp, upstream_wheel), "PR_AUTHOR": PR_AUTHOR})
