"""A decode worker with the radix cache and HiCache locks the host-backed span
of a prefix match until its restore (upstream's own flags; no series flag).

0.5.23 promises prefill the host-only part of a match but locks only the last
device node: host eviction before the restore is queued drops the promised
span, the restore FAILs and the request is aborted (HTTP 500). Real
``UnifiedRadixCache`` and decode queues on CPU (``harness.stacks.decode_hicache_stack``),
both radix tree cores; the churn workload is benchmark/decode_hicache's
"host-churn" configuration, where 0.5.23's admission fails restores.
"""

import copy
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.decode_hicache_scenarios import (
    HOST_CHURN,
    admission_sim,
    host_span_restore,
)

register_cpu_ci(est_time=120, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_span_released_when_nothing_evicts": "no eviction: upstream restores it as well"
}


_RUNS: dict = {}


class TestHostSpanLock(unittest.TestCase):
    tree_core = "python"

    def scenario(self, target, **kwargs):
        key = (target.__name__, self.tree_core, repr(sorted(kwargs.items())))
        if key not in _RUNS:
            _RUNS[key] = run_ranks(
                target, 1, tree_core=self.tree_core, seed_flag=False, **kwargs
            )
        return copy.deepcopy(_RUNS[key])[0]

    def test_locked_span_survives_host_eviction_and_restores_bit_exact(self):
        r = self.scenario(host_span_restore)
        self.assertEqual((r["l1"], r["l2"], r["promised"]), (0, 256, 256))
        self.assertTrue(r["host_locked"])
        self.assertEqual(r["host_evicted"], 0)
        self.assertEqual(r["status"], "ready")
        self.assertIs(r["restored_bytes_equal"], True)
        # Released once the restore's load_back holds the path.
        self.assertEqual(r["host_lock_refs"], 0)
        self.assertEqual(r["after"]["device_protected"], 0)

    def test_byte_check_sees_two_misplaced_rows(self):
        # Negative control of restored_bytes_equal: the same restore with two
        # of its device rows swapped afterwards compares unequal.
        r = self.scenario(host_span_restore, swap_restored_rows=True)
        self.assertEqual(r["status"], "ready")
        self.assertIs(r["restored_bytes_equal"], False)

    def test_span_released_when_nothing_evicts(self):
        r = self.scenario(host_span_restore, evict_host_first=False)
        self.assertEqual(r["status"], "ready")
        self.assertIs(r["restored_bytes_equal"], True)
        self.assertEqual(r["host_lock_refs"], 0)

    def test_no_failed_restore_under_host_churn(self):
        for seed in (0, 1):
            r = self.scenario(admission_sim, seed=seed, **HOST_CHURN)
            self.assertGreater(r["totals"]["admitted"], 10, seed)
            self.assertEqual(r["totals"]["failed_restores"], 0, seed)
            self.assertEqual(r["host_lock_refs"], 0, seed)


class TestHostSpanLockRust(TestHostSpanLock):
    tree_core = "rust"


if __name__ == "__main__":
    unittest.main()
