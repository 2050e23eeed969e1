"""End to end over the real transport: DP-rank processes with real radix trees
and the real ``PrefixDigestPublisher`` -> digest channel ->
``DataParallelController`` (cache_aware) -> requests land where their prefix is.

Each stand-in rank owns a ``UnifiedRadixCache`` (Rust core by default, Python
core too), preloads its own system prompt, inserts the tokens of every request
it receives and publishes its digest from its loop, wired like the scheduler
(KV events off, the digest tapping ``SchedulerKvEventsPublisher``).
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.dp_routing_fixtures import require_cache_aware_routing
from harness.gloo_ranks import run_ranks
from harness.scenarios.dp_routing_scenarios import cache_aware_end_to_end

register_cpu_ci(est_time=120, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")


def setUpModule():
    require_cache_aware_routing()


class TestCacheAwareEndToEnd(unittest.TestCase):
    def _check(self, out, dp):
        self.assertEqual(out["method"], "CACHE_AWARE")
        # 96-token prompts, 16-token chunks: 6 chunk hashes per rank.
        self.assertEqual(out["digests"], [6] * dp)
        for expected, landed in out["shared_prompt"]:
            self.assertEqual(landed, expected)
        # The first turn goes by load to the least loaded rank (dp-1), the
        # later turns follow the conversation's cache there.
        self.assertEqual(out["turns"], [dp - 1] * len(out["turns"]))
        self.assertEqual(out["stats"].get("miss"), 1)

    def test_rust_tree_core(self):
        out = run_ranks(cache_aware_end_to_end, 1, timeout=600, dp=3)[0]
        self._check(out, 3)

    def test_python_tree_core(self):
        out = run_ranks(
            cache_aware_end_to_end, 1, timeout=600, dp=2, tree_core="python", turns=2
        )[0]
        self._check(out, 2)


if __name__ == "__main__":
    unittest.main()
