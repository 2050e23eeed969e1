"""Cache-aware routing through the real DataParallelController dispatch path.

The controller is upstream's ``DataParallelController`` built for
``--load-balance-method cache_aware`` over scheduler stand-ins (processes that
report where each request landed). Loads are written through the real
load-snapshot SHM writers, digests are sent over the real digest channel;
every request goes through ``_request_dispatcher`` -> ``dispatching_with_trace``
-> ``refresh_load_budget`` -> ``cache_aware_scheduler``.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.dp_routing_fixtures import require_cache_aware_routing
from harness.gloo_ranks import run_ranks
from harness.scenarios.dp_routing_scenarios import (
    cache_aware_cases,
    landing_cases,
    pending_cases,
    stall_cases,
)

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")


def setUpModule():
    require_cache_aware_routing()


MAX_EXTRA = 2  # --dp-routing-max-extra-reqs of the scenario


class TestCacheAwareDispatch(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.out = run_ranks(cache_aware_cases, 1, timeout=600)[0]

    def assertLanded(self, case, rank, how):
        self.assertEqual(self.out[case], (rank, how), case)

    def test_method_and_channel(self):
        self.assertEqual(self.out["method"], "CACHE_AWARE")
        self.assertTrue(self.out["settled"])

    def test_missing_digest_balances_by_load(self):
        # loads 3, 1, 2, 5 running requests
        self.assertLanded("no_digest", 1, "no_digest")

    def test_misses_on_idle_ranks_spread(self):
        landed = [rank for rank, _ in self.out["miss_spread"]]
        self.assertEqual(landed, [2, 3, 0, 1], self.out["miss_spread"])
        self.assertEqual({how for _, how in self.out["miss_spread"]}, {"miss"})

    def test_misses_avoid_recently_busy_ranks(self):
        # The rotation points at rank 2, which just got 3 requests.
        for i in range(3):
            self.assertLanded(f"recent-{i}", 2, "match")
        self.assertLanded("recent-b", 1, "match")
        self.assertLanded("miss_avoids_recent", 3, "miss")

    def test_best_match(self):
        self.assertLanded("best_match", 2, "match")
        self.assertLanded("best_match_b", 1, "match")
        self.assertLanded("no_match", 2, "miss")  # least loaded

    def test_host_hits_weigh_less(self):
        # GPU 56 tokens beats host 64 (0.75 x 64 = 48) ...
        self.assertLanded("gpu_beats_longer_host", 3, "match")
        # ... host 64 beats GPU 40.
        self.assertLanded("host_beats_short_gpu", 1, "match")

    def test_override_at_exactly_the_threshold(self):
        self.assertLanded("extra_at_threshold", 2, "match")
        self.assertLanded("extra_over_threshold", 0, "override")
        self.assertLanded("extra_waiting_counts", 0, "override")

    def test_capacity_keeps_the_cached_prefix(self):
        # No room now but room in its pool: the best rank keeps it ...
        self.assertLanded("capacity_waits_on_best", 2, "match")
        # ... unless a rank with room holds as much of the prefix.
        self.assertLanded("capacity_same_prefix_elsewhere", 0, "capacity")
        # Cannot hold it even empty: the next best rank, else least loaded.
        self.assertLanded("capacity_next_best", 0, "capacity")
        self.assertLanded("capacity_least_loaded", 1, "capacity")

    def test_namespaces(self):
        self.assertLanded("salted", 1, "miss")
        self.assertLanded("salted_own_digest", 3, "match")

    def test_ineligible_and_tie(self):
        self.assertLanded("input_embeds", 2, "unsupported")
        self.assertLanded("tie", 2, "tie")

    def test_flush_restart_and_staleness(self):
        self.assertLanded("after_flush", 0, "miss")
        self.assertLanded("old_seq_ignored", 0, "miss")
        self.assertLanded("fresh_again", 2, "match")
        self.assertLanded("stale", 1, "no_digest")

    def test_burst_without_pending_scatters(self):
        burst = self.out["burst_without_pending"]
        self.assertEqual({how for _, how in burst}, {"miss"}, burst)
        self.assertGreater(len({rank for rank, _ in burst}), 1, burst)

    def test_counters(self):
        stats = self.out["stats"]
        self.assertEqual(stats["override"], 2)
        self.assertEqual(stats["capacity"], 3)
        self.assertEqual(stats["unsupported"], 1)
        self.assertEqual(
            sum(stats.values()),
            sum(1 for v in self.out.values() if isinstance(v, tuple))
            + len(self.out["miss_spread"])
            + len(self.out["burst_without_pending"]),
        )


class TestPendingPrefixes(unittest.TestCase):
    """--dp-routing-pending-ttl: a dispatched prefix counts on its rank until
    that rank's digest shows it or the TTL passes. From its dispatch on where
    a follower can reuse it from then on (``--disable-overlap-schedule
    --schedule-policy lpm``: in-batch prefix caching)."""

    TTL = 1.0

    @classmethod
    def setUpClass(cls):
        cls.out = run_ranks(pending_cases, 1, timeout=600, ttl=cls.TTL)[0]

    def test_credit_from_dispatch_under_in_batch_prefix_caching(self):
        self.assertFalse(self.out["credit_on_landing"])

    def test_burst_follows_its_first_request_up_to_the_override(self):
        self.assertTrue(self.out["settled"])
        burst = self.out["burst"]
        first = burst[0][0]
        self.assertEqual(
            burst[:3], [(first, "miss"), (first, "match"), (first, "match")], burst
        )
        self.assertNotEqual(burst[3][0], first)
        self.assertEqual(burst[3][1], "override")

    def test_confirmed_by_the_digest_that_shows_it(self):
        first = self.out["burst"][0][0]
        # 6 shared chunks + the last chunk of each of the 3 requests.
        self.assertEqual(self.out["pending_after_burst"][first], 9)
        self.assertEqual(self.out["pending_after_empty_digest"][first], 9)
        # The digest showing the first request's prompt confirms its 7
        # chunks (the digest holds chunk keys, the keys pending are stored
        # by); the other two requests' last chunks wait for the TTL.
        self.assertEqual(self.out["pending_after_confirm"][first], 2)

    def test_expires_after_the_ttl(self):
        rank, how = self.out["expiring"]
        self.assertEqual(how, "miss")
        self.assertEqual(self.out["before_ttl"], (rank, "match"))
        after_rank, after_how = self.out["after_ttl"]
        self.assertEqual(after_how, "miss")
        self.assertNotEqual(after_rank, rank)

    def test_restart_drops_pending(self):
        self.assertGreaterEqual(self.out["pending_before_restart"], 6)
        self.assertEqual(self.out["pending_after_restart"], 0)


class TestPrefillLandings(unittest.TestCase):
    """Under the default scheduler (overlap on, fcfs) a request cannot reuse
    a prefix whose prefill has not landed (``dp_routing.landing``): a
    dispatched prefix earns credit on its rank only from its landing on, up
    to the tokens landed (chunks of 8 tokens)."""

    @classmethod
    def setUpClass(cls):
        cls.out = run_ranks(landing_cases, 1, timeout=600)[0]
        cls.first = cls.out["burst"][0][0]

    def expected(self, n):
        sizes = [0] * 4
        sizes[self.first] = n
        return sizes

    def test_credit_from_landing_by_default(self):
        self.assertTrue(self.out["settled"])
        self.assertTrue(self.out["credit_on_landing"])

    def test_burst_before_its_landing_spreads_by_load(self):
        burst = self.out["burst"]
        self.assertEqual([how for _, how in burst], ["miss"] * 4, burst)
        self.assertEqual(sorted(rank for rank, _ in burst), [0, 1, 2, 3], burst)
        self.assertEqual(self.out["pending_before_landing"], [0] * 4)
        self.assertEqual(self.out["in_flight"], 4)

    def test_partial_landing_credits_its_whole_chunks_on_its_rank_only(self):
        # 15 tokens landed: one whole chunk; the wrong rank's report: none.
        self.assertEqual(self.out["pending_after_partial"], self.expected(1))

    def test_follower_after_the_landing_reuses_it(self):
        # 56 tokens: the prompt's 7 chunks, one credited before.
        self.assertEqual(self.out["pending_after_landing"], self.expected(7))
        self.assertEqual(self.out["after_landing"], (self.first, "match"))

    def test_a_client_routed_request_is_its_own_outcome_and_lands(self):
        # routed_dp_rank (a gateway's --dp-aware): served where it was sent,
        # counted once as "external" and in that rank's request count ...
        ext, landed, how = self.out["external"]
        self.assertEqual((landed, how), (ext, "external"))
        expected = [0] * 4
        expected[ext] = 1
        self.assertEqual(self.out["external_requests"], expected)
        self.assertEqual(self.out["stats"]["external"], 1)
        # ... and once it landed a follower of its fresh prefix goes there by
        # its match (no other rank holds any of it: a miss otherwise).
        self.assertEqual(self.out["after_external_landing"], (ext, "match"))

    def test_landing_of_an_unknown_rid_credits_nothing(self):
        before = self.out["pending_before_unknown"]
        self.assertEqual(self.out["pending_after_unknown"], before)
        self.assertEqual(self.out["u0_credited"], 0)
        # the in-flight request's own landing credits its 6 chunks
        after = list(before)
        after[self.out["rank_u"]] += 6
        self.assertEqual(self.out["pending_after_u0"], after)


class TestStalledRanks(unittest.TestCase):
    """A rank that sent no digest and no load snapshot for
    --dp-routing-digest-max-age is not chosen while another rank is live;
    routing returns to it when it reports again (the router's clock is the
    scenario's, so every step is exact)."""

    @classmethod
    def setUpClass(cls):
        cls.out = run_ranks(stall_cases, 1, timeout=600)[0]

    def assertLanded(self, case, rank, how):
        self.assertEqual(self.out[case], (rank, how), case)

    def test_before_the_stall(self):
        self.assertTrue(self.out["settled"])
        self.assertLanded("before_new", 1, "miss")
        self.assertLanded("before_prefix", 1, "match")

    def test_a_stale_digest_alone_is_not_a_stall(self):
        # Its load snapshot still advances (a busy rank): least loaded wins.
        self.assertLanded("busy_new", 1, "miss")
        self.assertLanded("load_just_stopped", 1, "miss")

    def test_stalled_rank_is_routed_around(self):
        # Its frozen snapshot is the lightest; the live ranks' lightest is 2.
        self.assertEqual(self.out["stalled_set"], [1])
        self.assertLanded("stalled_new", 2, "stall")
        self.assertLanded("stalled_prefix", 2, "stall")
        # A decision that never picked the stalled rank is unchanged.
        self.assertLanded("stalled_other_match", 2, "match")

    def test_no_live_rank_routes_as_before(self):
        self.assertEqual(self.out["all_stalled_set"], [0, 1, 2, 3])
        self.assertLanded("all_quiet", 1, "no_digest")

    def test_recovery(self):
        self.assertEqual(self.out["recovered_set"], [])
        self.assertLanded("recovered_prefix", 1, "match")
        self.assertLanded("recovered_new", 1, "miss")

    def test_one_warning_per_stall_and_counters(self):
        warnings = [m for level, m in self.out["log"] if level == "WARNING"]
        ranks = [int(m.split("DP rank ")[1].split()[0]) for m in warnings]
        # Rank 1 once over its three stalled dispatches, then the others
        # once each when every rank went quiet.
        self.assertEqual(ranks, [1, 0, 2, 3], warnings)
        self.assertIn("--dp-routing-digest-max-age 3.0", warnings[0])
        again = [m for level, m in self.out["log"] if "reports again" in m]
        self.assertEqual(len(again), 4, self.out["log"])
        self.assertEqual(self.out["stats"].get("stall"), 2, self.out["stats"])


if __name__ == "__main__":
    unittest.main()
