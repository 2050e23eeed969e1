"""Run one scenario against unpatched upstream and against the patched tree.

``run_scenario("upstream" | "patched", "harness.scenarios:l2_roundtrip",
world_size, **kwargs)`` starts a fresh interpreter (so the two sglang trees
never meet in one process) whose ``sglang`` is

* ``upstream``: the pristine unpacked pinned wheel (``build/upstream/...``),
  put first on ``PYTHONPATH``;
* ``patched``: the patched sglang installed in this interpreter's environment
  (``make test`` installs the built wheel), or ``$SGL_PATCHED_TREE`` if set.

It runs the scenario on ``world_size`` gloo ranks and returns the per-rank
results; ``diff_results`` lists every difference between two runs.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
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


def _tree_path(which: str) -> str | None:
    if which == "upstream":
        return str(upstream_tree())
    if which == "patched":
        return os.environ.get("SGL_PATCHED_TREE") or None
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
    tree = _tree_path(which)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.pkl"
        out = Path(tmp) / "out.pkl"
        spec.write_bytes(pickle.dumps((target, world_size, timeout, kwargs)))
        child_env = dict(os.environ)
        child_env.update(env or {})
        paths = [p for p in (tree, str(TESTS_DIR)) if p]
        child_env["PYTHONPATH"] = os.pathsep.join(paths)
        proc = subprocess.run(
            [sys.executable, "-m", "harness.compare", str(spec), str(out)],
            cwd=str(TESTS_DIR),
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout + 60,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{which} run of {target} failed (exit {proc.returncode}):\n"
                f"{proc.stderr[-6000:]}"
            )
        return pickle.loads(out.read_bytes())


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


def _child(spec_file: str, out_file: str) -> None:
    import importlib

    from harness.multiproc import run_ranks

    target, world_size, timeout, kwargs = pickle.loads(Path(spec_file).read_bytes())
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    results = run_ranks(fn, world_size, timeout=timeout, **kwargs)
    Path(out_file).write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
