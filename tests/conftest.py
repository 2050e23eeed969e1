"""Shared pytest setup: make ``harness`` and ``standins`` importable, and
run ``harness.gloo_ranks`` ranks on the warm-interpreter runner."""

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from harness import gloo_ranks, multiproc  # noqa: E402

gloo_ranks.set_runner(multiproc.run_ranks)
