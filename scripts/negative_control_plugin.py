"""pytest plugin of ``negative_controls.py``: how each test of a control failed.

``negative_controls.py`` copies this file into a control's scratch root (first
on ``PYTHONPATH``) and loads it with ``-p negative_control_plugin``. It writes
``$NEGATIVE_CONTROL_REPORT`` (JSON) at the end of the session:

* ``reports``: every setup/call/teardown report of a test that did not pass
  (and every passed call): node id, phase, outcome, and for a failure whether
  its exception is an ``AssertionError`` raised outside sglang's own code
  (``kind`` "assertion": the test's check, in the test, the harness or
  ``sglang.test``) or another exception, an ``AssertionError`` of sglang's
  own code included (``kind`` "error: <type>"), with the exception's text. Unittest
  subtests (one report each) and ``setUpClass`` failures (a failed setup) are
  reported here too.
* ``collection_errors``: every collector that failed to collect.
* ``sglang``: ``sglang.__file__`` in the test process, and the file of the
  mutated module (``$NEGATIVE_CONTROL_MODULE``) if the test process imported it.

Standard library and pytest only: it must import before anything of sglang.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

_REPORTS: list = []
_COLLECTION_ERRORS: list = []


def _product_dir() -> str | None:
    """The sglang package the test process imports (first on the path),
    found without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def _in_product(path: str) -> bool:
    """``path`` is sglang's own code: in the package, not in ``sglang.test``
    (where an upstream PR carries the test harness)."""
    product = _product_dir()
    if product is None:
        return False
    path = os.path.realpath(str(path))
    inside = path.startswith(product + os.sep)
    return inside and not path.startswith(os.path.join(product, "test") + os.sep)


def _kind(excinfo) -> str:
    if excinfo.errisinstance(AssertionError):
        # An assert of sglang's own code failing is not the test's check.
        where = excinfo.traceback[-1] if excinfo.traceback else None
        if where is not None and _in_product(where.path):
            return f"error: AssertionError in sglang ({where.path}:{where.lineno + 1})"
        return "assertion"
    return f"error: {excinfo.type.__name__}"


def _text(excinfo) -> str:
    try:
        return str(excinfo.value)[:4000]
    except Exception as exc:  # a broken __str__ is still an error of its type
        return f"<unprintable {excinfo.type.__name__}: {exc!r}>"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    entry = dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome)
    if report.failed and call.excinfo is not None:
        entry.update(kind=_kind(call.excinfo), message=_text(call.excinfo))
    elif report.failed:
        entry.update(kind="error: unknown", message=str(report.longrepr)[-4000:])
    elif report.skipped:
        entry.update(kind="skipped", message=str(report.longrepr)[-1000:])
    elif report.when != "call":
        return report  # a passed setup or teardown says nothing
    _REPORTS.append(entry)
    return report


def pytest_collectreport(report):
    if report.failed:
        _COLLECTION_ERRORS.append(
            dict(nodeid=report.nodeid, message=str(report.longrepr)[-4000:])
        )


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("NEGATIVE_CONTROL_REPORT")
    if not path:
        return
    sglang = sys.modules.get("sglang")
    mutated = sys.modules.get(os.environ.get("NEGATIVE_CONTROL_MODULE", ""))
    with open(path, "w") as f:
        json.dump(
            dict(
                reports=_REPORTS,
                collection_errors=_COLLECTION_ERRORS,
                exitstatus=int(exitstatus),
                sglang=getattr(sglang, "__file__", None),
                mutated_module=getattr(mutated, "__file__", None),
            ),
            f,
            indent=1,
        )
