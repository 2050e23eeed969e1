"""Per-test outcomes of a unittest file run as ``python3 test_x.py``.

``RUNNER`` is the source ``warm_python`` executes in place of the test file
(argv: the test file, then the JSON file to write): it replaces
``unittest.main`` by a program that runs the same tests with a result that
records, for every test id, how it ended, then runs the file as
``__main__``, exactly as upstream's CI runs it. ``classify`` reads that record.

Outcomes: ``pass``, ``skip``, ``assertion`` (an ``AssertionError``, the
test's own failure, in the test, a subtest or its class fixture), ``error:
<type>: <message>`` (any other exception: an ImportError, an AttributeError
from a missing module), ``not run``. A file whose import fails writes no
record (a collection error).
"""

from __future__ import annotations

import json
from pathlib import Path

RUNNER = r"""
import json, runpy, sys, unittest

_out = sys.argv.pop()
_outcomes = {}
_fixtures = {}  # class or module fixture errors, by the class they stop
_RANK = {"pass": 0, "skip": 0, "assertion": 1}


def _assertion(exc):
    # a group (hypothesis: several distinct failing examples) of assertions too
    if isinstance(exc, BaseExceptionGroup):
        return all(_assertion(e) for e in exc.exceptions)
    return isinstance(exc, AssertionError)


def _kind(test, err):
    if err is None:
        return "pass"
    if _assertion(err[1]):
        return "assertion"
    return f"error: {err[0].__name__}: {str(err[1]).splitlines()[0][:200] if str(err[1]) else ''}"


def _record(tid, kind):
    old = _outcomes.get(tid)
    if old is None or _RANK.get(kind, 2) > _RANK.get(old, 2):
        _outcomes[tid] = kind


class _Result(unittest.TextTestResult):
    def addSuccess(self, test):
        super().addSuccess(test)
        _record(test.id(), "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        _record(test.id(), _kind(test, err))

    def addError(self, test, err):
        super().addError(test, err)
        if isinstance(test, unittest.suite._ErrorHolder):
            # "setUpClass (module.Class)": every test of that class
            where = test.description.split("(", 1)[-1].rstrip(")")
            _fixtures[where] = _kind(test, err)
        else:
            _record(test.id(), _kind(test, err))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        _record(test.id(), "skip")

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            _record(test.id(), _kind(test, err))


def _ids(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from _ids(item)
        else:
            yield item.id()


class _Program(unittest.TestProgram):
    def __init__(self, *args, **kwargs):
        kwargs["testRunner"] = unittest.TextTestRunner(
            resultclass=_Result, verbosity=2
        )
        kwargs["exit"] = False
        super().__init__(*args, **kwargs)
        out = {}
        for tid in self.test_ids:
            cls = tid.rsplit(".", 1)[0]
            fixture = _fixtures.get(cls) or _fixtures.get(cls.rsplit(".", 1)[0])
            out[tid] = _outcomes.get(tid) or fixture or "not run"
        with open(_out, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
        sys.exit(0 if self.result.wasSuccessful() else 1)

    def runTests(self):
        self.test_ids = list(_ids(self.test))  # a suite drops its tests as they run
        super().runTests()


unittest.main = _Program
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def read(path: Path) -> dict[str, str] | None:
    """The record ``RUNNER`` wrote, or None when the file never reached
    ``unittest.main`` (its import failed, or it crashed)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _declared(tid: str, passing: dict[str, str]) -> bool:
    parts = tid.split(".")
    return parts[-1] in passing or ".".join(parts[-2:]) in passing


def unexpected_on_pristine(
    outcomes: dict[str, str] | None, passing: dict[str, str]
) -> dict[str, str]:
    """The test ids that did not end as a PR test's must on the pristine
    release, with how they ended: a failure by assertion, or a pass for those
    ``passing`` declares (``{"<file>": ...}`` when nothing was recorded, or
    when no test id failed by assertion at all)."""
    if outcomes is None:
        return {"<file>": "no test ran: the file's import failed or it crashed"}
    wrong = {}
    for tid, kind in outcomes.items():
        expected = "pass" if _declared(tid, passing) else "assertion"
        if kind != expected:
            wrong[tid] = f"{kind} (expected {expected})"
    if not any(k == "assertion" for k in outcomes.values()):
        wrong.setdefault("<file>", "no test id fails by assertion")
    return wrong
