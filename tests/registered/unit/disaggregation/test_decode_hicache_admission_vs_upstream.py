"""Decode-side HiCache admission against unpatched upstream 0.5.23: the
failures it and the fixes group fix reproduce on pristine upstream, and with
the feature off the patched tree behaves exactly like upstream where no fix
applies (``harness.compare``; the scenarios of
``harness.scenarios.decode_hicache_scenarios`` on both radix tree cores).
"""

import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.compare import run_scenario
from harness.result_diff import diff_results
from harness.scenarios.decode_hicache_scenarios import HOST_CHURN

register_cpu_ci(est_time=240, suite="base-a-test-cpu")
FEATURE_GROUP = "decode-hicache"  # the series group it tests (or "series")
PROJECT_ONLY = "compares with unpatched upstream (this project's harness.compare)"

HOST_SPAN = "harness.scenarios.decode_hicache_scenarios:host_span_restore"
SIM = "harness.scenarios.decode_hicache_scenarios:admission_sim"
L3 = "harness.scenarios.decode_hicache_scenarios:l3_two_phase"
PRESSURE = dict(size=1024, steps=24, arrivals=(1, 4))


# Differs by construction: the sglang tree, wall times, and the restored
# span's storage part (fixes/0008 counts it; 0.5.23 leaves it 0 on a decode
# restore: test_decode_restored_prefix_cached_tokens.py proves that fix).
_DIFFERS = ("sglang", "storage_hit_length")


def _strip(results):
    """Drop what differs by construction (``_DIFFERS``, ``seconds*``)."""
    return [
        {
            k: v
            for k, v in r.items()
            if k not in _DIFFERS and not k.startswith("seconds")
        }
        for r in results
    ]


class TestAgainstUpstream(unittest.TestCase):
    tree_core = "python"

    def both(self, target, l3_dir=False, **kwargs):
        """The scenario, feature off, on upstream and on the patched tree (an
        L3 scenario gets a fresh storage directory per run)."""
        kwargs.update(tree_core=self.tree_core, seed_flag=False)
        runs = []
        for which in ("upstream", "patched"):
            with tempfile.TemporaryDirectory() as d:
                extra = {"storage_dir": d} if l3_dir else {}
                runs.append(run_scenario(which, target, 1, **kwargs, **extra))
        up, patched = runs
        self.assertEqual(up[0]["sglang"]["version"], "0.5.23")
        self.assertNotEqual(up[0]["sglang"]["file"], patched[0]["sglang"]["file"])
        return up, patched

    def test_host_span_restore_fails_upstream_and_is_locked_flag_off(self):
        # The 0.5.23 failure: only the last device node is locked, host
        # eviction drops the promised span, the restore FAILs (HTTP 500). The
        # fixes group's host-span lock holds it with every feature off.
        up, patched = self.both(HOST_SPAN)
        self.assertEqual((up[0]["l1"], up[0]["l2"], up[0]["promised"]), (0, 256, 256))
        self.assertEqual(up[0]["host_evicted"], 256)
        self.assertEqual(up[0]["status"], "failed")
        self.assertEqual(patched[0]["host_evicted"], 0)
        self.assertEqual(patched[0]["status"], "ready")
        self.assertIs(patched[0]["restored_bytes_equal"], True)

    def test_host_churn_fails_restores_upstream_only(self):
        for seed in (0, 1):
            up, patched = self.both(SIM, seed=seed, **HOST_CHURN)
            self.assertGreater(up[0]["totals"]["failed_restores"], 0, seed)
            self.assertEqual(patched[0]["totals"]["failed_restores"], 0, seed)

    def test_admission_flag_off_identical_to_upstream(self):
        up, patched = self.both(SIM, seed=3, **PRESSURE)
        self.assertGreater(up[0]["totals"]["evict_calls"], 0)  # under pressure
        self.assertEqual(diff_results(_strip(up), _strip(patched)), [])

    def test_l3_upstream_promises_then_fails_and_flag_off_is_identical(self):
        for policy in ("best_effort", "wait_complete"):
            up, patched = self.both(L3, l3_dir=True, policy=policy)
            self.assertEqual(up[0]["evicted"], (256, 256))
            if policy == "best_effort":
                # best_effort stops the prefetch at the first check: upstream
                # has already promised the L3 span, so the restore FAILs.
                r = up[0]
                self.assertEqual(
                    (r["admitted_at"], r["l3"], r["promised"]), (0, 256, 256)
                )
                self.assertEqual(r["status"], "failed")
            self.assertEqual(diff_results(_strip(up), _strip(patched)), [])


class TestAgainstUpstreamRust(TestAgainstUpstream):
    tree_core = "rust"


if __name__ == "__main__":
    unittest.main()
