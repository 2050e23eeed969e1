"""Scheduler-side digest publishing: cadence, heartbeat, epochs, flush.

A real ``PrefixDigestPublisher`` wired to a real tree the way the scheduler
wires it (``SchedulerKvEventsPublisher`` with KV events off and the digest as
its ``event_tap``), sending over a real ZMQ socket; a manual clock drives the
publish interval.
"""

import os
import tempfile
import unittest
import uuid

from sglang.test.ci.ci_register import register_cpu_ci

from harness.dp_routing_fixtures import require_cache_aware_routing
from harness.stacks.radix_tree_fixtures import build_tree, insert

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")


def setUpModule():
    require_cache_aware_routing()


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class TestPrefixDigestPublisher(unittest.TestCase):
    def setUp(self):
        import zmq
        from sglang.srt.managers.dp_routing.publisher import PrefixDigestPublisher
        from sglang.srt.managers.scheduler_components.kv_events_publisher import (
            SchedulerKvEventsPublisher,
        )

        path = os.path.join(tempfile.gettempdir(), f"digest_{uuid.uuid4().hex}")
        self.endpoint = f"ipc://{path}.sock"
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(self.endpoint)
        self.clock = Clock()
        self.tree = build_tree(4, "rust")
        self.tree.cache.take_events()
        self.pub = PrefixDigestPublisher(
            self.endpoint,
            dp_rank=3,
            chunk_size=8,
            publish_interval=0.1,
            context=self.ctx,
            clock=self.clock,
        )
        self.kv_events = SchedulerKvEventsPublisher(
            kv_events_config=None,
            tree_cache=self.tree.cache,
            send_metrics_from_scheduler=None,
            max_running_requests=8,
            max_total_num_tokens=4096,
            get_stats=lambda: None,
            event_tap=self.pub.observe,
        )

    def tearDown(self):
        self.pub.close()
        self.pull.close(linger=0)
        self.ctx.term()

    def recv(self):
        import zmq
        from sglang.srt.managers.dp_routing.digest import CacheDigest

        if not self.pull.poll(2000, zmq.POLLIN):
            return None
        return CacheDigest.decode(self.pull.recv())

    def publish(self, dt):
        self.clock.t += dt
        return self.pub.maybe_publish(self.kv_events.publish_kv_events)

    def test_cadence_heartbeat_and_flush(self):
        from sglang.srt.managers.dp_routing.digest import unpack_hashes

        self.assertFalse(self.publish(1.0))  # not attached to a tree yet
        self.pub.attach(4, lambda: 1234)
        self.assertTrue(self.publish(0.0))  # first digest (empty)
        first = self.recv()
        self.assertEqual(
            (first.dp_rank, first.seq, first.page_size, first.chunk_size),
            (3, 1, 4, 8),
        )
        self.assertEqual(first.available_tokens, 1234)
        self.assertEqual(unpack_hashes(first.gpu_hashes), frozenset())

        insert(self.tree, list(range(1, 33)))
        self.assertFalse(self.publish(0.05))  # within the interval
        self.assertTrue(self.publish(0.06))  # changed: published, drained the tree
        d = self.recv()
        self.assertEqual(d.seq, 2)
        self.assertEqual(d.epoch, first.epoch)
        self.assertEqual(len(unpack_hashes(d.gpu_hashes)), 4)  # 32 tokens / 8
        self.assertFalse(self.pub.tracker.dirty)

        # Unchanged: nothing until the heartbeat (10 intervals).
        for _ in range(8):
            self.assertFalse(self.publish(0.11))
        self.assertTrue(self.publish(0.2))
        self.assertEqual(self.recv().seq, 3)

        # flush_cache resets the tree: an empty digest follows.
        self.tree.cache.reset()
        self.assertTrue(self.publish(0.11))
        self.assertEqual(unpack_hashes(self.recv().gpu_hashes), frozenset())

    def test_going_idle_sends_a_change_within_the_interval(self):
        # The scheduler forces the publish when the rank goes idle: a change
        # goes out at once, however recent the last digest; no change sends
        # nothing (the heartbeat keeps its cadence).
        from sglang.srt.managers.dp_routing.digest import unpack_hashes

        self.pub.attach(4, lambda: 0)
        self.assertTrue(self.publish(0.0))
        self.assertEqual(self.recv().seq, 1)
        insert(self.tree, list(range(1, 17)))
        self.clock.t += 0.01
        self.assertTrue(
            self.pub.maybe_publish(self.kv_events.publish_kv_events, force=True)
        )
        d = self.recv()
        self.assertEqual((d.seq, len(unpack_hashes(d.gpu_hashes))), (2, 2))
        self.clock.t += 0.01
        self.assertFalse(
            self.pub.maybe_publish(self.kv_events.publish_kv_events, force=True)
        )

    def test_restart_is_a_new_epoch(self):
        from sglang.srt.managers.dp_routing.publisher import PrefixDigestPublisher

        other = PrefixDigestPublisher(
            self.endpoint, dp_rank=3, chunk_size=8, publish_interval=0.1
        )
        self.addCleanup(other.close)
        self.assertNotEqual(other.epoch, self.pub.epoch)


if __name__ == "__main__":
    unittest.main()
