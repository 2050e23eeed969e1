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
