"""PD decode landings (cache-aware DP routing on a PD decode worker).

A PD decode rank runs no extend batch: a request's prompt KV arrives by
transfer and enters the decode radix tree when the request's prebuilt batch
is formed (``get_new_prebuilt_batch`` -> ``process_prebuilt`` ->
``checkpoint_kv_cache``). From then on a request the rank pre-allocates
(``pop_preallocated`` matches the tree) reuses it, so the decode DP leader
reports it as a landing then, and the controller of a decode worker with the
decode radix cache credits a dispatched prefix from that landing on (not from
its dispatch).

Scheduler side: the real ``SchedulerDisaggregationDecodeMixin
.get_new_prebuilt_batch`` over a stand-in scheduler whose prebuilt batch
checkpoints real ``Req`` objects (KV rows as ``_pre_alloc`` leaves them) into
a real ``UnifiedRadixCache``, the real ``PrefixDigestPublisher`` sending to
the router's ``LandingReceiver``. Controller side: the real
``DataParallelController`` of a decode worker (``dp_routing_scenarios.decode_landing_cases``).

Without the decode-landings patch: no landing is reported
(``test_prebuilt_batch_lands_when_formed``: ``[] != [(3, ['a', 'r'], ...)]``),
``credits_on_landing`` is False for decode (``test_credits_on_landing``), and
the controller credits at dispatch, so the burst follows its first request
(``test_burst_before_its_landing_spreads_by_load``).
"""

import os
import tempfile
import time
import types
import unittest
import uuid
from array import array

from sglang.test.ci.ci_register import register_cpu_ci

from harness.dp_routing_fixtures import require_cache_aware_routing
from harness.gloo_ranks import run_ranks

register_cpu_ci(est_time=30, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")

PAGE = 4


def setUpModule():
    require_cache_aware_routing()


def prebuilt_req(tree, rid, prompt_len, committed_len=None):
    """A transferred request as ``_pre_alloc`` leaves it: its KV row filled
    up to ``committed_len`` (the prompt; more for a retracted one), bound at
    the tree's root (``_bind_root_prefix``), one output token from prefill."""
    from sglang.srt.disaggregation.decode import _bind_root_prefix
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    committed = prompt_len if committed_len is None else committed_len
    prompt = [(hash((rid, i)) % 30000) + 1 for i in range(prompt_len)]
    r = Req(rid, "", array("q", prompt), SamplingParams())
    r.output_ids = [7] * (1 + committed - prompt_len)
    tree.req_to_token_pool.alloc([r])
    loc = tree.allocator.alloc(committed)
    tree.req_to_token_pool.write((r.kv.req_pool_idx, slice(0, committed)), loc)
    r.kv.kv_committed_len = committed
    r.kv.kv_allocated_len = committed
    r.full_untruncated_fill_ids = r.origin_input_ids + array("q", r.output_ids)
    r.extend_end = committed
    _bind_root_prefix(r, tree.cache)
    return r


class PrebuiltBatch:
    """What ``_get_new_prebuilt_batch`` returns, as far as the tree sees it:
    ``process_prebuilt`` checkpoints every request's committed KV."""

    def __init__(self, tree, reqs):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.tree = tree
        self.reqs = list(reqs)
        self.forward_mode = ForwardMode.PREBUILT

    def is_empty(self):
        return not self.reqs

    def process_prebuilt(self, future_map):
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        for req in self.reqs:
            checkpoint_kv_cache(req, self.tree.cache)


class TestDecodePrebuiltLanding(unittest.TestCase):
    def setUp(self):
        import zmq
        from sglang.srt.managers.dp_routing.channel import LandingReceiver
        from sglang.srt.managers.dp_routing.publisher import PrefixDigestPublisher

        from harness.stacks.radix_tree_fixtures import build_tree

        path = os.path.join(tempfile.gettempdir(), f"dlanding_{uuid.uuid4().hex}")
        self.ctx = zmq.Context()
        self.receiver = LandingReceiver(self.ctx, f"ipc://{path}_landing.sock")
        self.publisher = PrefixDigestPublisher(
            f"ipc://{path}.sock",
            dp_rank=3,
            chunk_size=8,
            publish_interval=0.1,
            context=self.ctx,
            landing_endpoint=f"ipc://{path}_landing.sock",
        )
        self.tree = build_tree(PAGE, "python")
        self.markers = 0
        self.assertEqual(self.received(), [], "connected")

    def tearDown(self):
        self.publisher.close()
        self.receiver.close()
        self.ctx.term()

    def received(self, timeout=30.0):
        """The landings reported so far (a marker sent after them on the
        same socket arrives after them), each with how many of its tokens
        the tree held when it arrived."""
        from sglang.srt.managers.dp_routing.landing import PrefillLanded

        from harness.stacks.radix_tree_fixtures import match

        self.markers += 1
        marker = PrefillLanded(dp_rank=3, rids=[f"marker-{self.markers}"], upto=[1])
        sender = self.publisher.landing_sender
        sent = False
        got = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sent = sent or sender.send(marker)
            if not self.receiver.socket.poll(50):
                continue
            for m in self.receiver.drain():
                if m.rids == marker.rids:
                    return got
                held = [
                    match(self.tree, self.prompts[rid][:upto]).device_prefix_len
                    for rid, upto in zip(m.rids, m.upto)
                ]
                got.append((m.dp_rank, m.rids, m.upto, held))
        raise AssertionError(f"marker not received within {timeout} s: {got}")

    def form(self, batch):
        """The real decode mixin forms ``batch`` as its next prebuilt batch."""
        from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin

        scheduler = types.SimpleNamespace(
            _get_new_prebuilt_batch=lambda running_batch: batch,
            _verify_kv_checksums=lambda b: None,
            ngram_embedding_manager=types.SimpleNamespace(
                prepare_for_forward=lambda b, chunked_req=None: b
            ),
            chunked_req=None,
            future_map=None,
            prefix_digest_publisher=self.publisher,
        )
        return SchedulerDisaggregationDecodeMixin.get_new_prebuilt_batch(
            scheduler, running_batch=None
        )

    def test_prebuilt_batch_lands_when_formed(self):
        # A transferred prompt (202 tokens, page 4: 200 in the tree), one
        # barred from the tree, and a retracted request (prompt 50, 60
        # committed: only the prompt counts).
        a = prebuilt_req(self.tree, "a", 202)
        s = prebuilt_req(self.tree, "s", 40)
        s.skip_radix_cache_insert = True
        r = prebuilt_req(self.tree, "r", 50, committed_len=60)
        self.prompts = {q.rid: list(q.origin_input_ids) for q in (a, s, r)}
        self.assertIsNotNone(self.form(PrebuiltBatch(self.tree, [a, s, r])))
        # Reported at once (no overlap hold), and the tree already holds the
        # reported tokens (page-floored) when the report arrives.
        self.assertEqual(
            self.received(), [(3, ["a", "r"], [202, 50], [200, 48])], "formed"
        )


class TestCreditsOnLanding(unittest.TestCase):
    def test_credits_on_landing(self):
        import inspect

        from sglang.srt.managers.dp_routing.router import credits_on_landing

        params = inspect.signature(credits_on_landing).parameters
        self.assertIn("decode_radix_cache", params, "decode's radix cache is read")

        def on(mode, pp=1, pdmux=False, radix=True, overlap_off=False, lpm=False):
            policy = "lpm" if lpm else "fcfs"
            return credits_on_landing(mode, pp, pdmux, overlap_off, policy, radix)

        # PD decode with its radix cache: from the landing on, whatever the
        # overlap scheduler and policy (decode matches at pre-allocation).
        self.assertTrue(on("decode"))
        self.assertTrue(on("decode", overlap_off=True, lpm=True))
        # Unchanged: PD prefill, PP, pdmux, decode without its radix cache.
        self.assertFalse(on("prefill"))
        self.assertFalse(on("decode", radix=False))
        self.assertFalse(on("decode", pp=2))
        self.assertFalse(on("decode", pdmux=True))
        self.assertTrue(on("null"))
        self.assertFalse(on("null", overlap_off=True, lpm=True))


class TestDecodeWorkerCreditsLandings(unittest.TestCase):
    """The real DataParallelController of a PD decode worker (4 DP ranks,
    chunks of 8 tokens)."""

    @classmethod
    def setUpClass(cls):
        from harness.scenarios.dp_routing_scenarios import decode_landing_cases

        cls.out = run_ranks(decode_landing_cases, 1, timeout=600)[0]
        cls.first = cls.out["burst"][0][0]

    def test_credit_from_landing_on_a_decode_worker(self):
        self.assertTrue(self.out["settled"])
        self.assertTrue(self.out["credit_on_landing"])
        self.assertTrue(self.out["landing_receiver"])

    def test_burst_before_its_landing_spreads_by_load(self):
        burst = self.out["burst"]
        self.assertEqual([how for _, how in burst], ["miss"] * 4, burst)
        self.assertEqual(sorted(rank for rank, _ in burst), [0, 1, 2, 3], burst)
        self.assertEqual(self.out["pending_before_landing"], [0] * 4)
        self.assertEqual(self.out["in_flight"], 4)

    def test_follower_after_the_decode_landing_reuses_it(self):
        expected = [0] * 4
        expected[self.first] = 7  # the 56-token prompt's 7 chunks
        self.assertEqual(self.out["pending_after_landing"], expected)
        self.assertEqual(self.out["after_landing"], (self.first, "match"))


if __name__ == "__main__":
    unittest.main()
