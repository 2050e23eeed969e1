"""The series' benchmarks, run as modules from the repository root:
``python -m benchmark.<feature>.<bench> [ARGS]``.

They build their stacks with the test harness (``tests/harness``,
``tests/standins``), whose modules import each other as the top-level packages
``harness`` and ``standins`` (the names ``make pr`` rewrites); importing this
package puts ``tests/`` on the path once, for every benchmark.
"""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
