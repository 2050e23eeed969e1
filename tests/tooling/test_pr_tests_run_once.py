"""Each PR test runs once per CI: collecting ``tests`` leaves the groups' PR
tests to ``make pr-check`` (tests/tooling/test_pr_check.py), keeps every
project-only and series-wide file, and a PR test named on the command line is
collected."""

import subprocess
import sys

from .conftest import ROOT, import_scripts

(pr_tests,) = import_scripts("pr_tests")


def _collected(*args) -> set[str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line.split("::")[0] for line in out.splitlines() if "::" in line}


def test_pr_tests_are_left_to_pr_check():
    registered = sorted(pr_tests.REGISTERED.rglob("test_*.py"))
    groups = {g for p in registered for g in pr_tests.declared_groups(p)}
    pr = {
        str(p.relative_to(ROOT))
        for g in groups - {pr_tests.SERIES_WIDE}
        for p in pr_tests.feature_tests(g)
    }
    others = {str(p.relative_to(ROOT)) for p in registered} - pr
    assert len(pr) > 1 and others
    # One collection (each costs the imports of every file it collects): the
    # folder and one PR test named beside it; the other PR tests stay out.
    named = sorted(pr)[0]
    collected = _collected("tests/registered", named)
    assert not (pr - {named}) & collected, sorted(pr & collected)
    assert others <= collected, sorted(others - collected)
    assert named in collected
