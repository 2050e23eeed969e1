"""Cache-aware DP routing under DP attention on a live server (CPU, tiny
DeepSeek-V3 with plain MLA, ``--tp 2 --dp-size 2 --enable-dp-attention``).

DeepSeek deployments run DP attention: one scheduler per attention DP rank,
the MLP tensor-parallel across all of them, every batch padded to the DP
group's size (on CPU with the torch_native backend since the fixes group's
fill value). The controller's cache-aware router dispatches to those DP ranks
from the digests their leader schedulers publish. Multi-turn conversations
(``harness.live_workloads``) sent by concurrent clients: each conversation
stays on one DP rank and every later turn is served its previous prompt from
cache; both ranks serve; ``/metrics`` counts every request once and shows one
fresh digest per DP rank. The server sends a changed digest no more than once
every ``DIGEST_INTERVAL_S`` except when a DP rank goes idle, which sends it at
once: eight short conversations (60-token first prompts, which fill no 64-token
digest chunk, so the router has no landing credit of theirs) all at once, then
their second turns 0.5 s after the first ones ended, each on its first turn's
rank and served that turn's prompt from cache: the router could only know from
the digests sent as the ranks went idle. The negative control on the same
server: the same
workload on conversations of its own (another seed), each request sent to the
DP rank client-side round robin names (``routed_dp_rank``), is served whole on
exactly the turns sent back to their previous rank, and misses the others. At the end of its life DP rank 1's scheduler is
SIGKILLed under 8 streams: every stream ends in an error within a bound (the
MLP is tensor-parallel over both ranks, so none can finish), the whole tree
exits and the port is free.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.faults import kill_during_streams
from harness.live_server import LiveServer, assert_all_gone, port_release
from harness.live_workloads import (
    ClientRoundRobin,
    full_hit_turns,
    hit_rate,
    run_conversations,
)
from harness.metrics import scrape

register_cpu_ci(est_time=300, suite="base-b-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")
PROJECT_ONLY = "runs this project's CPU server (stand-ins, local tiny model)"

DP_ATTENTION = ["--tp", "2", "--dp-size", "2", "--enable-dp-attention"]
# No throttled digest send within reach of the short conversations (the
# heartbeat: every ten intervals); the digests sent on going idle stay usable.
DIGEST_INTERVAL_S = 120
DIGEST_MAX_AGE_S = 600
ARGS = DP_ATTENTION + [
    "--load-balance-method",
    "cache_aware",
    "--enable-metrics",
    "--max-total-tokens",
    "4096",
    # Changed digests go out only when a rank goes idle (and as heartbeats
    # every ten intervals): the short conversations below see no other send.
    "--dp-routing-digest-publish-interval",
    str(DIGEST_INTERVAL_S),
    "--dp-routing-digest-max-age",
    str(DIGEST_MAX_AGE_S),
]
# The short conversations: turn 2 (98 tokens) finds turn 1's 67 tokens with
# KV (60 prompt + 7 of its 8 output tokens) on its rank, one full chunk of 64.
SHORT = dict(n=8, turns=2, seed=29, first=60, new_tokens=30, clients=8)
FAULT_BOUND_S = 60.0  # kill to every client answered and the tree gone
FAULT_TOKENS = 256  # 8 streams, 4 per rank, well inside a 4096-token pool


class TestCacheAwareRoutingDpAttentionServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        server = LiveServer("patched", ARGS, name="dp_attention", model="tiny-mla")
        try:
            cls.records = run_conversations(server, n=4, turns=3, seed=21)
            cls.metrics = server.get("/metrics").text
            cls.short = run_conversations(server, **SHORT)
            # Not routed by the router: not counted in cls.metrics either.
            cls.control_route = ClientRoundRobin(2)
            cls.control = run_conversations(
                server, n=4, turns=3, seed=23, route=cls.control_route
            )
            cls.log = server.log_text()
            # End of life: DP rank 1's scheduler killed under 8 streams.
            victim = server.roles()["sglang::scheduler_DP1_TP1"]
            cls.fault = kill_during_streams(
                server.base_url, server.pids(), victim, FAULT_TOKENS
            )
            cls.fault["port"] = port_release(server.port)
        except Exception as exc:
            raise RuntimeError(f"dp attention: {exc}\n{server.log_tail()}") from exc
        finally:
            pids = server.stop()
        assert_all_gone(pids)

    def test_runs_dp_attention(self):
        # Two attention DP ranks, each its own scheduler (log prefix DP<r> TP<r>).
        for rank in (0, 1):
            self.assertIn(f"DP{rank} TP{rank}]", self.log)
        self.assertIn("'enable_dp_attention': True", self.log)

    def test_conversations_stick_and_hit(self):
        for c, conv in enumerate(self.records):
            self.assertEqual(len({r["rank"] for r in conv}), 1, (c, conv))
            for prev, cur in zip(conv, conv[1:]):
                self.assertGreaterEqual(cur["cached"], prev["prompt"], (c, conv))
        self.assertEqual({conv[0]["rank"] for conv in self.records}, {0, 1})
        print(f"dp attention: hit rate {hit_rate(self.records):.3f}")

    def test_going_idle_sends_the_digest_the_next_turn_is_routed_by(self):
        # Without the send on going idle the second turns are misses, routed
        # by load: the rank with fewer recent dispatches, whatever holds them.
        for c, conv in enumerate(self.short):
            self.assertEqual(conv[0]["prompt"], SHORT["first"], (c, conv))
            self.assertEqual(conv[1]["rank"], conv[0]["rank"], (c, self.short))
            self.assertGreaterEqual(conv[1]["cached"], conv[0]["prompt"], (c, conv))
        self.assertEqual({conv[0]["rank"] for conv in self.short}, {0, 1})

    def test_client_round_robin_control_misses_where_it_moves_a_turn(self):
        # Every request served on the rank the client named (a server that
        # ignored routed_dp_rank would route it by cache and keep it).
        asked = self.control_route.asked
        for c, conv in enumerate(self.control):
            self.assertEqual([r["rank"] for r in conv], asked[c], (c, conv))
        # 4 conversations x 2 later turns; round robin over 4 requests a turn
        # sends a turn back to its previous rank when its place in the
        # (seeded) send order has the previous turn's parity (2 of 8 for seed
        # 23 when the clients take the requests in send order). Exactly those
        # are served their whole previous prompt: the other rank holds at
        # most the prompt of two turns back.
        kept = self.control_route.kept()
        full = full_hit_turns(self.control)
        print(
            f"dp attention control: {full} of 8 later turns whole, "
            f"hit rate {hit_rate(self.control):.3f}"
        )
        self.assertEqual(full, kept, (asked, self.control))
        self.assertLess(kept, 8, asked)  # it moves a turn: it can miss
        self.assertEqual(full_hit_turns(self.records), 8)

    def test_every_request_routed_once_and_one_digest_per_dp_rank(self):
        routed = {
            dict(k)["outcome"]: v
            for k, v in scrape(self.metrics, "sglang:dp_routing_requests_total").items()
        }
        requests = sum(len(conv) for conv in self.records)
        self.assertEqual(sum(routed.values()), requests, routed)
        # 4 conversations x 2 later turns, each routed by its match.
        self.assertGreaterEqual(routed.get("match", 0), 8, routed)
        ages = {
            dict(k)["dp_rank"]: v
            for k, v in scrape(
                self.metrics, "sglang:dp_routing_digest_age_seconds"
            ).items()
        }
        self.assertEqual(set(ages), {"0", "1"}, ages)
        self.assertTrue(all(0 <= a < 5.0 for a in ages.values()), ages)

    def test_a_killed_dp_rank_ends_every_stream_and_the_server(self):
        fault = self.fault
        print(f"DP attention rank kill: {fault}")
        self.assertEqual([s["state"] for s in fault["streams"]], ["error"] * 8, fault)
        self.assertIsNotNone(fault["clients_s"], fault)
        self.assertLess(fault["clients_s"], FAULT_BOUND_S, fault)
        self.assertEqual(fault["left"], [], fault)
        self.assertIsNotNone(fault["tree_s"], fault)
        self.assertTrue(fault["port"]["free"], fault)


if __name__ == "__main__":
    unittest.main()
