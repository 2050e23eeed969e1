"""Every difference between two scenario results (nested dicts, lists,
tuples, bytes and scalars), as readable lines naming where."""

from __future__ import annotations

UPSTREAM_TEST_MODULE = "sglang.test.result_diff"


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
