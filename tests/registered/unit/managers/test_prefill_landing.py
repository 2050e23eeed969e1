"""Scheduler-side prefill landings (``dp_routing.landing``): which requests of
a formed batch a DP leader reports, and when, over the real landing channel.

A request received after a landing report finds the reported prompt tokens in
the tree: without the overlap scheduler an extend batch's result is processed
before the next batch is formed, so its prefills land when it is formed; with
it, the next batch is formed before that result is processed, so they land
when the batch after it is formed (or none is). Real ``Req`` objects with the
scheduler's ``extend_end`` (prefix + this round's extend), the real
``PrefixDigestPublisher`` sending to the router's ``LandingReceiver``.
"""

import os
import tempfile
import time
import types
import unittest
import uuid

from sglang.test.ci.ci_register import register_cpu_ci

from harness.dp_routing_fixtures import require_cache_aware_routing

register_cpu_ci(est_time=10, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")


def setUpModule():
    require_cache_aware_routing()


def req(rid, prompt_len, extend_end):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    r = Req(rid, "", list(range(1, prompt_len + 1)), SamplingParams())
    r.extend_end = extend_end
    return r


def batch(mode, *reqs):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(forward_mode=getattr(ForwardMode, mode), reqs=reqs)


class TestPrefillLanding(unittest.TestCase):
    def setUp(self):
        import zmq
        from sglang.srt.managers.dp_routing.channel import LandingReceiver
        from sglang.srt.managers.dp_routing.publisher import PrefixDigestPublisher

        path = os.path.join(tempfile.gettempdir(), f"landing_{uuid.uuid4().hex}")
        self.ctx = zmq.Context()
        self.receiver = LandingReceiver(self.ctx, f"ipc://{path}_landing.sock")
        self.publisher = PrefixDigestPublisher(
            f"ipc://{path}.sock",
            dp_rank=3,
            chunk_size=64,
            publish_interval=0.1,
            context=self.ctx,
            landing_endpoint=f"ipc://{path}_landing.sock",
        )
        self.markers = 0
        self.assertEqual(self.received(), [], "connected")

    def tearDown(self):
        self.publisher.close()
        self.receiver.close()
        self.ctx.term()

    def received(self, timeout=30.0):
        """The landings reported so far: a marker sent after them on the same
        socket arrives after them (one connection keeps the order), so
        everything before it is what was sent. The sender queues nothing
        until it is connected (IMMEDIATE), so the marker is sent again until
        a send takes."""
        from sglang.srt.managers.dp_routing.landing import PrefillLanded

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
                got.append((m.dp_rank, m.rids, m.upto))
        raise AssertionError(f"marker not received within {timeout} s: {got}")

    def test_without_overlap_an_extend_batch_lands_when_formed(self):
        # A prefill (200 of 200), a chunk of a chunked prefill (prefix 0, 128
        # of 300 tokens) and a retracted request re-prefilling its outputs
        # (only the prompt counts).
        b = batch("EXTEND", req("a", 200, 200), req("c", 300, 128), req("r", 50, 60))
        self.publisher.batch_formed(b, overlap=False)
        self.assertEqual(
            self.received(), [(3, ["a", "c", "r"], [200, 128, 50])], "formed"
        )
        self.publisher.batch_formed(batch("DECODE", req("d", 10, 10)), overlap=False)
        self.publisher.batch_formed(None, overlap=False)
        self.assertEqual(self.received(), [], "decode and idle report nothing")

    def test_with_overlap_an_extend_batch_lands_when_the_next_is_formed(self):
        first = batch("EXTEND", req("a", 200, 200))
        self.publisher.batch_formed(first, overlap=True)
        self.assertEqual(self.received(), [], "its result is not processed yet")
        self.publisher.batch_formed(batch("EXTEND", req("b", 80, 80)), overlap=True)
        self.assertEqual(self.received(), [(3, ["a"], [200])])
        self.publisher.batch_formed(None, overlap=True)  # idle: b's result next
        self.assertEqual(self.received(), [(3, ["b"], [80])])
        self.publisher.batch_formed(None, overlap=True)
        self.assertEqual(self.received(), [])


if __name__ == "__main__":
    unittest.main()
