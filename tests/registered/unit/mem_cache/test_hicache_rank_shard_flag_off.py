"""Rank-sharded HiCache host tier, flag off: two gloo ranks run the sharded
round trip on pristine upstream and on the patched tree (``harness.compare``)
and return identical transfers, contents and group counts.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.compare import run_scenario
from harness.result_diff import diff_results

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "hicache-rank-shard"  # the series group it tests (or "series")
PROJECT_ONLY = "compares with unpatched upstream (this project's harness.compare)"
SCENARIO = "harness.scenarios.hicache_rank_shard_scenarios:sharded_roundtrip"


class TestRankShardFlagOff(unittest.TestCase):
    def test_two_ranks_flag_off_equal_upstream(self):
        kwargs = dict(seed=7, steps=24, count_groups=True)
        upstream = run_scenario("upstream", SCENARIO, 2, **kwargs)
        patched = run_scenario("patched", SCENARIO, 2, **kwargs)
        self.assertEqual(upstream[0]["sglang"]["version"], "0.5.23")
        self.assertTrue(patched[0]["sglang"]["version"].startswith("0.5.23+"))
        for r in upstream + patched:
            r.pop("sglang")
            self.assertFalse(r["sharded"])
            self.assertEqual(r["groups_created"], 0)
            self.assertEqual(r["mismatches"], [])
            # The comparison covers what it is about: backups and load-backs
            # that reached the device (each checked bit for bit above).
            done = [e for e in r["events"] if len(e) == 3 and isinstance(e[2], list)]
            self.assertGreater(len([e for e in done if e[0] == "write"]), 0)
            self.assertGreater(len([e for e in done if e[0] == "load"]), 0)
            self.assertTrue(r["trace"], "no kvcacheio transfer traced")
        self.assertEqual(diff_results(upstream, patched), [])


if __name__ == "__main__":
    unittest.main()
