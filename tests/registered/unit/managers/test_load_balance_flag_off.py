"""Flag off = upstream: the existing load-balance methods dispatch identically.

Runs ``harness.scenarios.dp_routing_scenarios.dispatch_trace`` -- upstream's
``DataParallelController`` over scheduler stand-ins, seeded requests (lengths,
bootstrap rooms) and seeded per-rank loads written through the real SHM
load-snapshot writers -- against pristine upstream 0.5.23 and against the
patched tree, and compares the landing rank of every request per method.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.compare import run_scenario
from harness.result_diff import diff_results

register_cpu_ci(est_time=210, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")
PROJECT_ONLY = "compares dispatch traces with unpatched upstream"

SCENARIO = "harness.scenarios.dp_routing_scenarios:dispatch_trace"
METHODS = ("round_robin", "total_requests", "total_tokens", "follow_bootstrap_room")


class TestLoadBalanceFlagOff(unittest.TestCase):
    def test_existing_methods_dispatch_like_upstream(self):
        kwargs = dict(methods=METHODS, dp_size=3, seed=5, n=40, timeout=600)
        upstream = run_scenario("upstream", SCENARIO, 1, **kwargs)[0]
        patched = run_scenario("patched", SCENARIO, 1, **kwargs)[0]
        self.assertEqual(upstream["sglang"]["version"], "0.5.23")
        self.assertNotEqual(upstream["sglang"]["file"], patched["sglang"]["file"])
        runs = upstream["runs"]
        self.assertEqual(set(runs), set(METHODS))
        # The scenario discriminates: the methods route differently and the
        # load-aware ones follow the crafted loads (not all on one rank).
        landings = {m: tuple(r["landed"]) for m, r in runs.items()}
        self.assertEqual(len(set(landings.values())), len(METHODS))
        for m in ("total_requests", "total_tokens"):
            self.assertGreater(len(set(landings[m])), 1, m)
        self.assertEqual(diff_results(runs, patched["runs"]), [])


if __name__ == "__main__":
    unittest.main()
