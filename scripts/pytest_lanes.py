#!/usr/bin/env python3
"""Run the test suite as two pytest processes at once (``make pytest``).

    python scripts/pytest_lanes.py [--tests DIR] [PYTEST_ARGS...]

The ``live`` lane holds the files that keep every core busy on their own: the
live servers (``registered/server``), ``make pr-check`` of the four groups,
the cheap negative controls and the serve-cpu demo. The ``unit`` lane holds
everything else: unit tests, gloo rank runs and the tooling tests, which
mostly wait on git, make and one interpreter at a time (about half of two
cores). Run one after the other, the unit lane's idle half is lost; run
beside the live lane, it fills it. Every test file is in exactly one lane:
the files under a live path listed in ``UNIT_IN_LIVE`` run in the unit lane.

``make pr-check`` stays in the live lane although it is its longest stretch:
its warm interpreters hold sglang imported, and beside a live lane's servers
they can push the machine's available memory under the 10 GB that upstream's
host-pool check keeps free (``pool_host/base.py``), which refuses a live
server's start ("Not enough host memory available").

The live lane's output streams; the unit lane's is printed when both have
ended (pytest's progress lines would interleave). Exits 1 when a lane failed
(a lane that collects nothing, e.g. under ``-k``, is no failure unless both
do). PYTEST_ARGS go to both lanes; to run some files, call pytest directly.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, run_main

# Paths under the tests folder (a folder or a file) run by the live lane.
LIVE = (
    "registered/server",
    "tooling/test_pr_check.py",
    "tooling/test_negative_controls.py",
    "tooling/test_serve_cpu.py",
)
# Files under a live path that run in the unit lane: they start no server and
# allocate no host pool (the startup refusals end in the launcher's server-args
# resolution, before any scheduler).
UNIT_IN_LIVE = ("registered/server/test_startup_refusals.py",)
NO_TESTS = 5  # pytest's exit status when it collected nothing


def lanes(tests: Path) -> dict[str, list[str]]:
    """Each lane's pytest arguments (paths and ``--ignore``s)."""
    live = [tests / p for p in LIVE if (tests / p).exists()]
    moved = [tests / p for p in UNIT_IN_LIVE if (tests / p).exists()]
    # the unit lane ignores the live lane's files one by one, so that it
    # still collects the moved ones
    live_files = sorted(
        f
        for p in live
        for f in ([p] if p.is_file() else p.rglob("test_*.py"))
        if f not in moved
    )
    return {
        "live": [str(p) for p in live] + [f"--ignore={f}" for f in moved],
        "unit": [str(tests)] + [f"--ignore={f}" for f in live_files],
    }


def run_lanes(tests: Path, args: list[str]) -> int:
    procs, logs, seconds = {}, {}, {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pytest-lanes-") as tmp:
        for name, paths in lanes(tests).items():
            if not paths:
                continue
            cmd = [sys.executable, "-m", "pytest", *paths, *args]
            if name == "live":
                procs[name] = subprocess.Popen(cmd, cwd=ROOT)
            else:
                logs[name] = open(Path(tmp) / f"{name}.log", "w+")
                procs[name] = subprocess.Popen(
                    cmd, cwd=ROOT, stdout=logs[name], stderr=subprocess.STDOUT
                )

        def wait(name):
            procs[name].wait()
            seconds[name] = time.monotonic() - start

        waiters = [threading.Thread(target=wait, args=(n,)) for n in procs]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join()
        for name, log in logs.items():
            log.seek(0)
            print(f"\n===== {name} lane =====", flush=True)
            sys.stdout.write(log.read())
            log.close()
    codes = {name: proc.returncode for name, proc in procs.items()}
    print()
    for name in procs:
        print(f"{name} lane: pytest exit {codes[name]} after {seconds[name]:.0f} s")
    ran = [c for c in codes.values() if c != NO_TESTS]
    return 0 if ran and all(c == 0 for c in ran) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=Path, default=ROOT / "tests")
    known, rest = parser.parse_known_args(argv)
    return run_lanes(known.tests.resolve(), rest)


if __name__ == "__main__":
    run_main(lambda: sys.exit(main()))
