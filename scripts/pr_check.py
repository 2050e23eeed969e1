#!/usr/bin/env python3
"""Run a feature's PR tests as upstream's CI would, on the PR alone.

    python scripts/pr_check.py cache-aware-routing    # make pr-check FEATURE=...
    python scripts/pr_check.py fixes --pristine-only  # only the runs on pristine

Extracts the PR (``make_pr``), lays out build/pr-check/<feature>/ as
upstream's repository (``python/sglang`` = the pinned release with the PR's
patches at zero fuzz, ``test/registered/...`` and the test modules the PR
adds), then runs each test file as upstream's CPU CI does: ``python3
test_x.py`` in its folder, with only ``python/`` on the path. The interpreter
is this one (the CPU test venv's packages). While the patches are applied one
by one, every prefix must import: after each patch the modules touched so far
are imported, which also proves that ``import sglang`` resolves to the layout,
not to an installed sglang. A test that declares ``LANDS_WITH = "NNNN"``
also runs on the prefix ending at that patch, before the whole PR.

First, before any patch, every test runs on the pristine release and must
fail there, each of its test ids by its own assertion (``unittest_outcomes``:
an import error, a collection error or a crash does not count): a PR test
that passes without its patches proves nothing about them. A test that passes on pristine on purpose (a flag-off comparison with
upstream) declares why: ``PASSES_ON_PRISTINE = "<reason>"``, and must pass.

Every run and check is forked from a warm interpreter (``warm_python``)
that has the third-party packages imported already (torch, transformers,
...; never sglang for the runs on the PR and its prefixes), which saves
each run about half its start. Each run and check is a
job that holds one slot while it runs (one per core, ``Slots``): the pristine
runs use their own copy of the unpatched layout and overlap the prefix walk
and the runs on the PR, which run side by side, the longest first.
``PR_CHECK_SLOTS=<fifo>`` shares the slots among several pr_check processes
(one byte per slot in the FIFO, as make's jobserver).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import unittest_outcomes
from common import BUILD, ToolError, group_needs, read_series, run_main
from lint_product import lint, patch_files
from make_pr import apply_each, apply_stacked_on, copy_pristine, make_pr
from pr_tests import (
    cpu_registration,
    feature_tests,
    lands_with,
    passes_on_pristine,
    passing_tests_on_pristine,
    upstream_test_path,
)
from warm_python import THIRD_PARTY, WarmPython

# A test's time limit: its registered estimate times this, at least the floor
# (the estimate is for upstream's CI machines; ours may be slower and busy).
TIMEOUT_FACTOR = 6
TIMEOUT_FLOOR_S = 300


def layout_env(layout: Path) -> dict:
    """This environment without this project's settings (SGL_*), with only the
    layout's python/ on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGL_")}
    env["PYTHONPATH"] = str(layout / "python")
    return env


def _run(warm: WarmPython, path: Path, env: dict, limit: float, log: Path) -> str:
    """``python3 <test>`` in its folder, forked from ``warm``; on timeout the
    test's whole session (its ranks, servers) is killed."""
    code = warm.run([path.name], path.parent, env, log, limit)
    if code is None:
        return f"FAIL (over {limit:.0f} s)"
    return "pass" if code == 0 else f"FAIL ({code})"


def touched_modules(patches: list[Path]) -> list[str]:
    """The Python modules that these upstream-layout patches add or change."""
    modules = []
    for patch in patches:
        for rel in re.findall(r"(?m)^\+\+\+ b/python/(\S+)\.py$", patch.read_text()):
            name = rel.replace("/", ".").removesuffix(".__init__")
            if name not in modules:
                modules.append(name)
    return modules


def import_check(
    warm: WarmPython, layout: Path, env: dict, modules: list[str], name: str
) -> None:
    """Every prefix of the PR builds: after each patch, the modules it and the
    patches before it touch are imported in an interpreter that has imported
    no sglang yet (forked from ``warm``, which holds only third-party
    packages), which first proves that ``import sglang`` resolves to the
    layout."""
    log = layout / "import-check.log"
    code = warm.run(
        ["-c", *modules], layout, env, log, IMPORT_TIMEOUT_S, code=_IMPORT_ALL
    )
    output = log.read_text()
    expected = layout / "python" / "sglang" / "__init__.py"
    where = output.strip().splitlines()[:1]
    if where != [str(expected)]:
        raise ToolError(
            f"import sglang does not resolve to {expected}: {output.strip()[-2000:]}"
        )
    if code != 0:
        raise ToolError(
            f"the PR up to {name} does not import ({', '.join(modules)}):\n"
            + output[-3000:]
        )
    print(f"imports after {name}: {len(modules)} module(s)", flush=True)


_IMPORT_ALL = (
    "import importlib, sys\nimport sglang\nprint(sglang.__file__, flush=True)\n"
    "for m in sys.argv[1:]:\n    importlib.import_module(m)"
)
# The pristine runs' warm interpreter also holds pristine sglang itself (the
# layout is not patched while it runs).
PRISTINE_PRELOAD = THIRD_PARTY + ("sglang", "sglang.test.ci.ci_register")
IMPORT_TIMEOUT_S = 600


def pr_check(
    feature: str, pristine_only: bool = False
) -> list[tuple[str, str, float, str]]:
    """The group's checks as jobs, each holding one of the machine's slots
    (``Slots``) while it runs: the pristine runs (a copy of the layout that
    no patch touches, ``<feature>@pristine``), the walk through the PR's
    prefixes (each prefix's import check; a test that lands early runs on a
    copy of its prefix, ``<feature>@NNNN``), then the lint and the runs on
    the whole PR. The pristine runs overlap the walk and the runs on the PR,
    so the cores stay busy; rows come back in that order."""
    slots = Slots.from_env()
    with slots.hold():
        out = make_pr(feature, os.environ.get("PR_AUTHOR") or None)
    entries = [e for e in read_series() if e.startswith(feature + "/")]
    root = BUILD / "pr-check"
    layout = root / feature
    for old in [*root.glob(feature), *root.glob(f"{feature}@*")]:
        shutil.rmtree(old)
    layout.mkdir(parents=True)
    env = layout_env(layout)
    copy_pristine(layout)
    needs = group_needs(feature)
    apply_stacked_on(out, needs, layout)
    base = "pristine 0.5.23" + "".join(f" + {n.split('-')[0]}" for n in needs)
    shutil.copytree(out / "tests", layout, dirs_exist_ok=True)
    tests = sorted((layout / "test" / "registered").rglob("test_*.py"))
    if not tests:
        raise ToolError(f"the {feature} PR carries no test that runs upstream")
    rel = {layout / upstream_test_path(src): src for src in feature_tests(feature)}
    landing = {path: lands_with(src, entries) for path, src in rel.items()}
    on_pristine = {path: passes_on_pristine(src) for path, src in rel.items()}
    passing = {path: passing_tests_on_pristine(src) for path, src in rel.items()}
    pristine = _snapshot(layout, root / f"{feature}@pristine")

    def pristine_runs():
        p_env = layout_env(pristine)
        with _warm(slots, PRISTINE_PRELOAD, pristine / "python") as warm:
            rows = []
            for path in tests:
                with slots.hold():
                    rows.append(
                        run_pristine(
                            warm,
                            pristine,
                            pristine / path.relative_to(layout),
                            p_env,
                            on_pristine.get(path),
                            base,
                            passing.get(path),
                        )
                    )
            return rows

    with concurrent.futures.ThreadPoolExecutor(2 * len(tests) + 2) as pool:
        first = pool.submit(pristine_runs)
        if pristine_only:
            return first.result()
        early = []
        with _warm(slots, THIRD_PARTY, None) as warm:

            def after_each(name: str, applied: list[Path]) -> None:
                with slots.hold():
                    import_check(warm, layout, env, touched_modules(applied), name)
                if name == entries[-1]:  # the whole PR runs every test below
                    return
                lands = [path for path in tests if landing.get(path) == name]
                if lands:
                    prefix = Path(name).name[:4]
                    snap = _snapshot(layout, root / f"{feature}@{prefix}")
                    for path in lands:
                        early.append(
                            pool.submit(
                                slots.run,
                                _run_test,
                                warm,
                                snap,
                                snap / path.relative_to(layout),
                                layout_env(snap),
                                f" (up to {prefix})",
                            )
                        )

            apply_each(out, entries, layout, after_each)
            lint = pool.submit(slots.run, _lint, out, entries, layout)
            # the longest first (by its registered estimate): none left alone
            # at the end
            longest = sorted(
                tests, key=lambda p: -float(cpu_registration(p).get("est_time", 60))
            )
            whole = {
                p: pool.submit(slots.run, _run_test, warm, layout, p, env)
                for p in longest
            }
            return [
                *first.result(),
                *(f.result() for f in early),
                lint.result(),
                *(whole[p].result() for p in tests),
            ]


def _snapshot(layout: Path, dest: Path) -> Path:
    """A copy of the layout as it is now (its python/ and test/), for runs
    that must see this state while the layout moves on."""
    for part in ("python", "test"):
        shutil.copytree(layout / part, dest / part, symlinks=True)
    return dest


@contextlib.contextmanager
def _warm(slots: "Slots", preload, sglang_path: Path | None):
    """A warm interpreter, started while holding a slot (its imports are
    the costly part); idle, it holds none."""
    warm = WarmPython(preload, sglang_path=sglang_path)
    with slots.hold():
        warm.__enter__()
    try:
        yield warm
    finally:
        warm.__exit__(None, None, None)


class Slots:
    """At most N checks at once: an in-process semaphore of the machine's
    cores, or, when ``PR_CHECK_SLOTS`` names a FIFO holding one byte per slot
    (as make's jobserver), the slots shared by every pr_check process that
    uses it (the tooling test runs the four groups at once this way)."""

    def __init__(self, fifo: str | None = None):
        self.fd = os.open(fifo, os.O_RDWR) if fifo else None
        self.sem = threading.Semaphore(os.cpu_count() or 1) if not fifo else None

    @classmethod
    def from_env(cls) -> "Slots":
        return cls(os.environ.get("PR_CHECK_SLOTS") or None)

    @contextlib.contextmanager
    def hold(self):
        if self.sem is not None:
            with self.sem:
                yield
            return
        token = os.read(self.fd, 1)
        if not token:
            raise ToolError("PR_CHECK_SLOTS: the slot FIFO was closed")
        try:
            yield
        finally:
            os.write(self.fd, token)

    def run(self, fn, *args):
        with self.hold():
            return fn(*args)


LINT = "lint"  # the suite column of the lint row


def _lint(out: Path, entries: list[str], layout: Path):
    """Upstream's linters (scripts/lint_product.py) on the PR's tree: the
    files its own patches add or change (the new modules need upstream's
    license header) and the test files it carries."""
    files, new = patch_files([out / Path(name).name for name in entries])
    carried = sorted(
        str(p.relative_to(out / "tests")) for p in (out / "tests").rglob("*.py")
    )
    start = time.monotonic()
    findings = lint(layout, files + [f for f in carried if f not in files], new)
    result = "pass" if not findings else f"FAIL ({len(findings)} finding(s))"
    row = (
        "upstream's linters on the PR's files",
        LINT,
        time.monotonic() - start,
        result,
    )
    print(f"{result:>14}  {row[2]:6.1f} s  {row[1]}  {row[0]}", flush=True)
    for f in findings:
        print(f"{f.path}: {f.tool}\n{f.detail}", file=sys.stderr)
    return row


def _time_limit(registration: dict) -> float:
    """A test's time limit from its ``register_cpu_ci`` estimate."""
    return max(
        TIMEOUT_FLOOR_S, TIMEOUT_FACTOR * float(registration.get("est_time", 60))
    )


def _run_test(warm: WarmPython, layout: Path, path: Path, env: dict, where: str = ""):
    rel = str(path.relative_to(layout)) + where
    reg = cpu_registration(path)
    limit = _time_limit(reg)
    log = path.with_suffix(".log")
    start = time.monotonic()
    result = _run(warm, path, env, limit, log)
    row = (rel, reg.get("suite", "?"), time.monotonic() - start, result)
    print(f"{result:>14}  {row[2]:6.1f} s  {row[1]}  {rel}", flush=True)
    if result != "pass":
        print(log.read_text()[-4000:], file=sys.stderr)
    return row


def run_pristine(
    warm: WarmPython,
    layout: Path,
    path: Path,
    env: dict,
    reason: str | None,
    base: str = "pristine 0.5.23",
    passing_tests: dict | None = None,
):
    """The test on the pristine release (no patch of the PR applied yet; a PR
    stacked on fixes has those), forked from ``warm`` as ``python3 <test>`` in
    its folder: each test id must fail by assertion, but those it declares
    to pass (``PASSES_ON_PRISTINE_TESTS``), or the whole file must pass when
    it declares why it passes without the PR (``PASSES_ON_PRISTINE``)."""
    declared = passing_tests or {}
    rel = str(path.relative_to(layout)) + f" ({base})"
    reg = cpu_registration(path)
    limit = _time_limit(reg)
    log = path.with_suffix(".pristine.log")
    record = path.with_suffix(".pristine.json")
    record.unlink(missing_ok=True)
    start = time.monotonic()
    code = warm.run(
        [path.name, record], path.parent, env, log, limit, code=unittest_outcomes.RUNNER
    )
    outcome = "pass" if code == 0 else f"FAIL ({code})"
    if code is None:  # a hang is no failure of the test's own
        outcome = f"FAIL (over {limit:.0f} s)"
    passed = code == 0
    if reason is None:
        # Each test id must fail by its own assertion: an import error, a
        # collection error or a crash proves nothing about the PR.
        others = unittest_outcomes.unexpected_on_pristine(
            unittest_outcomes.read(record), declared
        )
        listed = "; ".join(
            f"{'.'.join(tid.split('.')[-2:])}: {kind}"
            for tid, kind in sorted(others.items())
        )
        if passed and not declared:
            result = "FAIL (passes without the PR)"
        elif others:
            result = f"FAIL (not by assertion: {listed})"
        else:
            result = "fails as required"
        ok = code is not None and not others
    else:
        result = (
            f"passes: {reason}" if passed else f"FAIL (declared to pass: {outcome})"
        )
        ok = code is not None and passed
    if code is None:
        result = outcome
    row = (
        rel,
        reg.get("suite", "?"),
        time.monotonic() - start,
        "pass" if ok else result,
    )
    print(f"{result}  {row[2]:6.1f} s  {row[1]}  {rel}", flush=True)
    if not ok:
        print(log.read_text()[-4000:], file=sys.stderr)
    return row


class _WholeLines:
    """A stream that writes each thread's output a whole line at a time, so
    that the rows of jobs running at once do not interleave mid-line."""

    def __init__(self, stream):
        self.stream, self.lock, self.local = stream, threading.Lock(), threading.local()

    def write(self, text: str) -> int:
        pending = getattr(self.local, "pending", "") + text
        done, sep, self.local.pending = pending.rpartition("\n")
        if sep:
            with self.lock:
                self.stream.write(done + "\n")
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


def main() -> None:
    sys.stdout, sys.stderr = _WholeLines(sys.stdout), _WholeLines(sys.stderr)
    args = sys.argv[1:]
    pristine_only = "--pristine-only" in args
    args = [a for a in args if a != "--pristine-only"]
    if len(args) != 1:
        raise ToolError("usage: pr_check.py <feature group> [--pristine-only]")
    rows = pr_check(args[0], pristine_only)
    runs = [r for r in rows if r[1] != LINT]
    failed = [r for r in rows if r[3] != "pass"]
    passed = len([r for r in runs if r[3] == "pass"])
    print(f"{passed} of {len(runs)} PR test runs pass upstream-style")
    if failed:
        raise ToolError("failed upstream-style: " + ", ".join(r[0] for r in failed))


if __name__ == "__main__":
    run_main(main)
