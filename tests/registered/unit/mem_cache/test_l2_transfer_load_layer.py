"""L2TransferEngine._load_layer is a pure move: flag-off behaviour equals upstream.

Runs the same seeded scenario -- backups, device evictions, load-backs and host
evictions of a DSA stack (MLA KV + DSA indexer host pools, built through
upstream's ``_DsaStrategy`` on CPU) -- against unpatched upstream 0.5.23 and
against the patched sglang, and compares the trace of every transfer call (op,
pool, layer, page indices, bytes) and the final device and host contents.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.compare import run_scenario
from harness.result_diff import diff_results

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "hicache-rank-shard"  # the series group it tests (or "series")
PROJECT_ONLY = "compares transfer traces and contents with unpatched upstream"

SCENARIO = "harness.scenarios.hicache_l2_scenarios:l2_roundtrip"


def _strip_identity(results):
    return [{k: v for k, v in r.items() if k != "sglang"} for r in results]


class TestLoadLayerFlagOff(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.upstream = {
            seed: run_scenario("upstream", SCENARIO, 1, seed=seed, steps=40)
            for seed in (1, 2)
        }

    def test_trace_and_contents_identical_to_upstream(self):
        for seed, upstream in self.upstream.items():
            patched = run_scenario("patched", SCENARIO, 1, seed=seed, steps=40)
            self.assertEqual(upstream[0]["sglang"]["version"], "0.5.23")
            self.assertTrue(patched[0]["sglang"]["version"].startswith("0.5.23+"))
            self.assertNotEqual(
                upstream[0]["sglang"]["file"], patched[0]["sglang"]["file"]
            )
            # The scenario really moved data: loads happened and all verified.
            loads = [e for e in upstream[0]["events"] if e[0] == "load" and len(e) == 5]
            self.assertGreaterEqual(len(loads), 5)
            self.assertTrue(all(e[3] and e[4] for e in loads), loads)
            ops = {c["op"] for c in upstream[0]["trace"]}
            self.assertEqual(ops, {"d2h_all_layer", "h2d_layer"})
            self.assertEqual(
                diff_results(_strip_identity(upstream), _strip_identity(patched)), []
            )

    def test_negative_control_altered_transfer_is_caught(self):
        upstream = self.upstream[1]
        altered = run_scenario(
            "patched", SCENARIO, 1, seed=1, steps=40, alter_h2d_call=3
        )
        diffs = diff_results(_strip_identity(upstream), _strip_identity(altered))
        self.assertTrue(any(".trace[" in d and "dst_pages" in d for d in diffs), diffs)
        self.assertTrue(any(".events[" in d for d in diffs), diffs)


if __name__ == "__main__":
    unittest.main()
