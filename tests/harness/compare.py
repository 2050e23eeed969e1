"""Run one scenario against unpatched upstream and against the patched tree.

``run_scenario("upstream" | "patched",
"harness.scenarios.hicache_l2_scenarios:l2_roundtrip", world_size, **kwargs)``
runs the scenario on ``world_size`` gloo ranks (``harness.gloo_ranks.run_ranks``)
whose ``sglang`` is

* ``upstream``: the pristine unpacked pinned wheel (``build/upstream/...``),
  the ranks forked in that tree's warm interpreter
  (``harness.tree_interpreter``), so the two sglang trees never meet in one
  process;
* ``patched``: the patched sglang installed in this interpreter's environment
  (``make test`` installs the built wheel), the ranks forked from this
  process's fork server; or ``$SGL_PATCHED_TREE`` if set, through that
  tree's warm interpreter.

It returns the per-rank results; ``harness.result_diff.diff_results`` lists
every difference between two runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.gloo_ranks import run_ranks

TESTS_DIR = Path(__file__).resolve().parent.parent
ROOT = TESTS_DIR.parent


def upstream_tree() -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import upstream
    finally:
        sys.path.pop(0)
    return upstream.prepare()[1]


def patched_tree() -> str | None:
    return os.environ.get("SGL_PATCHED_TREE") or None


def _tree_path(which: str) -> str | None:
    if which == "upstream":
        return str(upstream_tree())
    if which == "patched":
        return patched_tree()
    raise ValueError(f"unknown tree {which!r}")


def run_scenario(
    which: str,
    target: str,
    world_size: int = 1,
    *,
    timeout: float = 900.0,
    env: dict | None = None,
    **kwargs,
):
    from harness.tree_interpreter import interpreter_for, run_target

    tree = _tree_path(which)
    if tree is None:
        return run_ranks(
            run_target, world_size, target, timeout=timeout, env=env, **kwargs
        )
    return interpreter_for(tree).run(
        target, world_size, (), kwargs, timeout=timeout, env=env
    )


def run_code(code: str, payload, pythonpath=None, timeout: float = 600):
    """``python -c code`` in a fresh interpreter of this environment, with
    ``pythonpath`` (e.g. ``upstream_tree()``) first on ``PYTHONPATH``, fed
    ``payload`` as JSON on stdin; the JSON its last output line holds."""
    import json
    import subprocess

    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH")) if p
        )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise AssertionError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])
