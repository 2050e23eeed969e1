"""A decode ABORT that reaches a PD prefill worker before the request does fails
the request's sender as soon as prefill creates it (upstream's flags; no series
flag).

A router (SMG, sglang's mini load balancer) posts a request to prefill and
decode at once. When decode refuses it at once (a request the empty decode pool
cannot admit, fixes/0007), its KV receiver's ABORT can reach prefill's mooncake
bootstrap thread before prefill's scheduler has created the request's sender.
0.5.23 drops an ABORT for a room it holds no status for ("ignoring (already
completed or unknown)"), so the sender then waits for decode's KV indices until
its bootstrap timeout (300 s by default). The real prefill-side
``MooncakeKVManager`` and ``MooncakeKVSender`` on CPU
(``harness.scenarios.pd_prefill_abort_scenarios``): a sender created after its
room's ABORT polls Failed at once, naming the early abort; a sender that
existed before its ABORT fails on both trees, one never aborted keeps
bootstrapping; an ABORT older than the bootstrap timeout is dropped.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.pd_prefill_abort_scenarios import early_decode_abort

register_cpu_ci(est_time=90, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")

# The retention bound is the bootstrap timeout; a short one lets an ABORT
# expire within the test.
SHORT_TIMEOUT_S = 3
EXPIRED_AFTER_S = SHORT_TIMEOUT_S + 1.0


class TestPrefillEarlyDecodeAbort(unittest.TestCase):
    def run_scenario(self, env=None, **kwargs):
        (r,) = run_ranks(early_decode_abort, 1, env=env, timeout=240, **kwargs)
        print(r)
        return r

    def assert_failed_by_early_abort(self, r, name):
        # 0.5.23: Bootstrapping, until the bootstrap timeout fails it
        self.assertEqual(r["polls"][name], "Failed", r)
        self.assertIn(
            f"Decode aborted bootstrap room {r['rooms'][name]} ", r["reasons"][name]
        )
        self.assertIn("before this prefill received the request", r["reasons"][name])

    def test_abort_before_the_sender_fails_it_at_once(self):
        r = self.run_scenario()
        self.assertEqual(r["bootstrap_timeout"], 300)  # upstream's default bound
        self.assert_failed_by_early_abort(r, "early")
        # the abort path 0.5.23 already has, and a room no one aborted
        self.assertEqual(r["polls"]["present"], "Failed", r)
        self.assertEqual(r["polls"]["never"], "Bootstrapping", r)
        # retained until its sender came, then used up
        self.assertEqual(r["retained_before"], [r["rooms"]["early"]], r)
        self.assertEqual(r["retained_after"], [], r)

    def test_an_abort_older_than_the_bootstrap_timeout_is_dropped(self):
        env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(SHORT_TIMEOUT_S)}
        r = self.run_scenario(env=env, expired_abort_s=EXPIRED_AFTER_S)
        self.assertEqual(r["bootstrap_timeout"], SHORT_TIMEOUT_S)
        # a fresh abort still fails its sender at once ...
        self.assert_failed_by_early_abort(r, "early")
        # ... one past the bound was purged when the fresh one came and no
        # longer fails a sender created for its room
        self.assertEqual(r["retained_before"], [r["rooms"]["early"]], r)
        self.assertEqual(r["polls"]["expired"], "Bootstrapping", r)
        self.assertEqual(r["polls"]["never"], "Bootstrapping", r)
        self.assertEqual(r["retained_after"], [], r)


if __name__ == "__main__":
    unittest.main()
