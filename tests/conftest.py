"""Shared pytest setup: make ``harness`` and ``standins`` importable and leave
the groups' PR tests to ``make pr-check``.

A PR test (a registered test of a series group that is not ``PROJECT_ONLY``)
runs once per CI: ``tests/tooling/test_pr_check.py`` runs every group's PR
tests as upstream's CPU CI does, on the pinned release with that PR alone, so
collecting ``tests`` (or a folder of it) skips them here. A PR test file named
on the command line runs here too.
"""

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

_SCRIPTS = TESTS_DIR.parent / "scripts"
sys.path.insert(0, str(_SCRIPTS))
try:
    import pr_tests  # noqa: E402
finally:
    sys.path.remove(str(_SCRIPTS))


def _named_files(config) -> set[Path]:
    out = set()
    for arg in config.args:
        path = Path(arg.split("::")[0])
        if path.suffix == ".py":
            out.add(path.resolve())
    return out


def pytest_ignore_collect(collection_path, config):
    path = Path(collection_path).resolve()
    if path.suffix != ".py" or pr_tests.REGISTERED not in path.parents:
        return None
    groups = pr_tests.declared_groups(path)
    if groups in ([], [pr_tests.SERIES_WIDE]) or pr_tests.project_only(path):
        return None
    if path in _named_files(config):
        return None
    return True  # run by make pr-check (tests/tooling/test_pr_check.py)
