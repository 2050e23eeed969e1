"""Fixtures for the tooling tests: isolated build/patches dirs sharing the
real download cache and unpacked upstream tree (never the real build/src)."""

from __future__ import annotations

import concurrent.futures
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


# The groups ``built_prs`` extracts, and the author it gives their patches.
PR_GROUPS = ("hicache-rank-shard", "cache-aware-routing", "decode-hicache")
PR_AUTHOR = "Jane Doe <jane@example.com>"


@pytest.fixture(scope="session")
def built_prs(tmp_path_factory, upstream_wheel):
    """``make_pr.py <group>`` of each of ``PR_GROUPS`` once per session, in
    one sandbox (``PR_AUTHOR`` set), for the tests that only read what it
    writes; a test that changes patches/ or the build makes its own
    (``sandbox``). Returns the sandbox and each group's process."""
    tmp = tmp_path_factory.mktemp("built-prs")
    env = {**sandbox_env(tmp, upstream_wheel), "PR_AUTHOR": PR_AUTHOR}
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        procs = pool.map(lambda g: run_script("make_pr.py", g, env=env), PR_GROUPS)
        return tmp, dict(zip(PR_GROUPS, procs))


def built_pr(built_prs, group: str) -> Path:
    """build/pr/<group> of ``built_prs``, once its make_pr is known to have
    passed."""
    tmp, procs = built_prs
    assert procs[group].returncode == 0, procs[group].stderr
    return tmp / "build" / "pr" / group
