"""Run one scenario against unpatched upstream and against the patched tree.

``run_scenario("upstream" | "patched", "harness.scenarios:l2_roundtrip",
world_size, **kwargs)`` runs the scenario on ``world_size`` gloo ranks forked
from that tree's warm interpreter (``harness.warm_tree``; the two sglang trees
never meet in one process) whose ``sglang`` is

* ``upstream``: the pristine unpacked pinned wheel (``build/upstream/...``),
  put first on ``PYTHONPATH``;
* ``patched``: the patched sglang installed in this interpreter's environment
  (``make test`` installs the built wheel), or ``$SGL_PATCHED_TREE`` if set.

It returns the per-rank results; ``diff_results`` lists every difference
between two runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
    from harness.warm_tree import warm_tree

    return warm_tree(_tree_path(which)).run(
        target, world_size, (), kwargs, timeout=timeout, env=env
    )


def diff_results(a, b, path: str = "", limit: int = 20) -> list[str]:
    """Human-readable differences between two results (empty when equal)."""
    diffs: list[str] = []

    def walk(x, y, where):
        if len(diffs) >= limit:
            return
        if type(x) is not type(y):
            diffs.append(f"{where}: type {type(x).__name__} != {type(y).__name__}")
        elif isinstance(x, dict):
            for k in sorted(set(x) | set(y), key=str):
                if k not in x or k not in y:
                    diffs.append(f"{where}.{k}: only in {'b' if k not in x else 'a'}")
                else:
                    walk(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, (list, tuple)):
            if len(x) != len(y):
                diffs.append(f"{where}: length {len(x)} != {len(y)}")
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{where}[{i}]")
        elif isinstance(x, bytes):
            if x != y:
                first = next(
                    (i for i, (u, v) in enumerate(zip(x, y)) if u != v),
                    min(len(x), len(y)),
                )
                diffs.append(
                    f"{where}: bytes differ (first at offset {first} of {len(x)})"
                )
        elif x != y:
            diffs.append(f"{where}: {x!r} != {y!r}")

    walk(a, b, path or "result")
    return diffs
