"""scripts/pytest_lanes.py (``make pytest``): the live lane and the unit lane
run at once, every test file in exactly one of them, and a failure in either
fails the run."""

import subprocess
import sys
from pathlib import Path

from .conftest import ROOT, SCRIPTS, import_scripts

(pytest_lanes,) = import_scripts("pytest_lanes")

# Each side waits for the other's file: run one after the other, the first
# would wait out its 60 s and fail.
RENDEZVOUS = """
import os, time
from pathlib import Path

SHARED = Path({shared!r})


def test_meets_the_other_lane():
    (SHARED / {mine!r}).touch()
    deadline = time.monotonic() + 60
    while not (SHARED / {theirs!r}).exists():
        assert time.monotonic() < deadline, "the other lane did not run meanwhile"
        time.sleep(0.05)
    assert {ok!r}, "this lane's own failure"
"""


def _tree(tmp_path, live_ok=True):
    tests = tmp_path / "tests"
    shared = tmp_path / "shared"
    shared.mkdir()
    files = {
        "registered/server/test_live.py": ("live", "unit", live_ok),
        "tooling/test_unit.py": ("unit", "live", True),
    }
    for rel, (mine, theirs, ok) in files.items():
        path = tests / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            RENDEZVOUS.format(shared=str(shared), mine=mine, theirs=theirs, ok=ok)
        )
    return tests


def _run(tests):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "pytest_lanes.py"), "--tests", str(tests)]
        + ["-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_lanes_run_at_once_and_both_pass(tmp_path):
    proc = _run(_tree(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "live lane: pytest exit 0" in proc.stdout
    assert "unit lane: pytest exit 0" in proc.stdout
    assert proc.stdout.count("1 passed") == 2, proc.stdout


def test_a_failing_lane_fails_the_run(tmp_path):
    proc = _run(_tree(tmp_path, live_ok=False))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "this lane's own failure" in proc.stdout
    assert "live lane: pytest exit 1" in proc.stdout
    assert "unit lane: pytest exit 0" in proc.stdout


def test_every_test_file_is_in_exactly_one_lane():
    tests = ROOT / "tests"
    lanes = pytest_lanes.lanes(tests)
    live = [p for p in lanes["live"] if not p.startswith("--ignore=")]
    moved = [a.removeprefix("--ignore=") for a in lanes["live"][len(live) :]]
    ignored = [a.removeprefix("--ignore=") for a in lanes["unit"][1:]]
    assert lanes["unit"][0] == str(tests)
    # every live path and every file moved to the unit lane exists (a
    # renamed file would silently move lanes)
    assert len(live) == len(pytest_lanes.LIVE)
    assert moved == [str(tests / p) for p in pytest_lanes.UNIT_IN_LIVE]
    files = sorted(tests.rglob("test_*.py"))
    in_live = [
        f
        for f in files
        if any(f.is_relative_to(p) for p in live) and str(f) not in moved
    ]
    # the unit lane ignores exactly the live lane's files, and runs the moved ones
    assert sorted(ignored) == sorted(str(f) for f in in_live)
    assert all(any(Path(m).is_relative_to(p) for p in live) for m in moved)
    assert in_live and len(in_live) < len(files)
    assert any(f.parts[-3:-1] == ("registered", "server") for f in in_live)
