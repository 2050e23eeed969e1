"""The routing sockets of cache-aware DP routing: what reaches them, where
they live, when they go.

Malformed digests and landings pushed over real sockets into the router's
real receivers are dropped, each with the reason it names, and warned of at
most once per reason a minute with the count since the last warning; the
well-formed ones still pass. The sockets live in one directory per server
instance of mode 0700 that the launcher makes only under cache_aware, an
existing path is accepted only as such a directory of this user, and the
directory goes as soon as the process that binds its sockets dies, even
killed.
"""

import logging
import multiprocessing
import os
import shutil
import signal
import stat
import tempfile
import time
import unittest
import uuid
from types import SimpleNamespace

import msgspec
from sglang.test.ci.ci_register import register_cpu_ci

from harness.dp_routing_fixtures import require_cache_aware_routing

register_cpu_ci(est_time=30, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")
LANDS_WITH = "0006"  # passes from this patch of the group on (pr-check runs it there)


def setUpModule():
    require_cache_aware_routing()


DP, PAGE, CHUNK = 2, 4, 16


def digest(**fields) -> bytes:
    """A CacheDigest in its wire form (a msgpack array of its fields)."""
    d = dict(
        dp_rank=0,
        epoch=1,
        seq=1,
        page_size=PAGE,
        chunk_size=CHUNK,
        timestamp=1.0,
        available_tokens=100,
        capacity_tokens=0,
        gpu_hashes=b"",
        host_hashes=b"",
        is_bigram=False,
        version=2,
    )
    d.update(fields)
    return msgspec.msgpack.encode(list(d.values()))


def landing(rank, rids, upto) -> bytes:
    return msgspec.msgpack.encode([rank, rids, upto])


# (reason, payload): what each malformed message is dropped for.
BAD_DIGESTS = [
    ("gpu_hashes", digest(gpu_hashes=b"\x00" * 13)),
    ("host_hashes", digest(host_hashes=b"\x00" * 12)),
    ("dp_rank", digest(dp_rank=DP)),
    ("dp_rank", digest(dp_rank=-1)),
    ("chunk_size", digest(chunk_size=0)),
    ("chunk_size", digest(chunk_size=2 * CHUNK)),
    ("page_size", digest(page_size=-PAGE)),
    ("page_size", digest(page_size=3)),
    ("seq", digest(seq=0)),
    ("epoch", digest(epoch=-1)),
    ("available_tokens", digest(available_tokens=-1)),
    ("capacity_tokens", digest(capacity_tokens=-1)),
    ("timestamp", digest(timestamp=float("nan"))),
    ("version", digest(version=1)),
    ("shape", digest(is_bigram=1)),
    ("shape", msgspec.msgpack.encode([0, 1, 1])),
    ("shape", msgspec.msgpack.encode(list(range(13)))),
    ("shape", msgspec.msgpack.encode({"dp_rank": 0})),
    ("msgpack", b""),
    ("msgpack", b"\xc1"),
]
BAD_LANDINGS = [
    ("dp_rank", landing(7, ["a"], [10])),
    ("dp_rank", landing(-1, ["a"], [10])),
    ("rids", landing(0, [], [])),
    ("rids", landing(0, ["a", ""], [10, 10])),
    ("upto", landing(0, ["a", "b"], [10])),
    ("upto", landing(0, ["a"], [0])),
    ("shape", landing(0, ["a"], [1.5])),
    ("shape", msgspec.msgpack.encode([0, ["a"], [1], 4])),
    ("msgpack", b"\xc1"),
]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class TestMalformedMessages(unittest.TestCase):
    def setUp(self):
        import zmq
        from sglang.srt.managers.dp_routing.channel import (
            DigestReceiver,
            LandingReceiver,
        )
        from sglang.srt.managers.dp_routing.router import CacheAwareRouter

        self.tmp = tempfile.mkdtemp()
        self.ctx = zmq.Context()
        self.router = CacheAwareRouter(
            num_dp_ranks=DP,
            max_extra_reqs=4,
            digest_max_age=60.0,
            pending_ttl=60.0,
            receiver=DigestReceiver(
                self.ctx,
                f"ipc://{self.tmp}/digest.sock",
                num_ranks=DP,
                chunk_size=CHUNK,
            ),
            credit_on_landing=True,
            landing_receiver=LandingReceiver(
                self.ctx, f"ipc://{self.tmp}/landing.sock", num_ranks=DP
            ),
        )
        self.clock = FakeClock()
        for receiver in self.receivers().values():
            receiver.dropped.clock = self.clock
        self.push = {}
        for name in ("digest", "landing"):
            self.push[name] = self.ctx.socket(zmq.PUSH)
            self.push[name].setsockopt(zmq.LINGER, 0)
            self.push[name].connect(f"ipc://{self.tmp}/{name}.sock")
        self.warnings = Warnings()
        logging.getLogger("sglang.srt.managers.dp_routing").addHandler(self.warnings)

    def tearDown(self):
        logging.getLogger("sglang.srt.managers.dp_routing").removeHandler(self.warnings)
        for s in self.push.values():
            s.close()
        self.router.close()
        self.ctx.term()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def receivers(self):
        return {
            "digest": self.router.receiver,
            "landing": self.router.landing_receiver,
        }

    def deliver(self, name, payload):
        """Pushes ``payload``; returns what the receiver passes on of it."""
        receiver = self.receivers()[name]
        self.push[name].send(payload)
        self.assertTrue(receiver.socket.poll(30_000), "not delivered")
        return list(receiver.drain())

    def test_each_malformed_message_is_dropped_for_its_reason(self):
        from sglang.srt.managers.data_parallel_controller import DPBudget
        from sglang.srt.managers.dp_routing.request import RoutedRequest

        for name, cases in (("digest", BAD_DIGESTS), ("landing", BAD_LANDINGS)):
            dropped = self.receivers()[name].dropped
            for reason, payload in cases:
                before = dropped.total[reason]
                self.assertEqual(self.deliver(name, payload), [], (name, reason))
                self.assertEqual(dropped.total[reason], before + 1, (name, reason))
        # The well-formed ones pass and are routed by: rank 1 holds the
        # prompt's first chunk, a dispatched request's landing on rank 0
        # makes its chunks pending there.
        from sglang.srt.managers.dp_routing.chunk_keys import (
            DEFAULT_NAMESPACE,
            RequestChunks,
        )
        from sglang.srt.managers.dp_routing.digest import pack_hashes

        prompt = list(range(1, 3 * CHUNK + 1))
        keys = RequestChunks(prompt, PAGE, CHUNK, DEFAULT_NAMESPACE).keys
        for rank, held in ((0, []), (1, keys[:1])):
            got = self.deliver(
                "digest", digest(dp_rank=rank, gpu_hashes=pack_hashes(held))
            )
            self.assertEqual([d.dp_rank for d in got], [rank])
            self.router.update_digest(got[0])
        budget = DPBudget(DP)
        decision = self.router.select(RoutedRequest(prompt), budget, [0, 1])
        self.assertEqual((decision.rank, decision.outcome), (1, "match"))
        other = list(range(1000, 1000 + 3 * CHUNK))
        first = self.router.select(RoutedRequest(other, rid="q"), budget, [0, 1])
        got = self.deliver("landing", landing(first.rank, ["q"], [3 * CHUNK]))
        self.assertEqual(
            [(m.dp_rank, m.rids, m.upto) for m in got],
            [(first.rank, ["q"], [3 * CHUNK])],
        )
        self.router.on_landed(got[0])
        self.assertEqual(len(self.router.pending.expiry[first.rank]), 3)

    def test_warnings_at_most_once_per_reason_a_minute(self):
        from sglang.srt.managers.dp_routing.channel import DROP_WARNING_INTERVAL_S

        self.assertEqual(DROP_WARNING_INTERVAL_S, 60.0)
        bad_rank, bad_keys = BAD_DIGESTS[2][1], BAD_DIGESTS[0][1]
        for _ in range(5):
            self.deliver("digest", bad_keys)
        self.deliver("digest", bad_rank)
        self.clock.now += 59.0
        self.deliver("digest", bad_keys)
        self.assertEqual(len(self.warnings.messages), 2, self.warnings.messages)
        self.clock.now += 1.0
        self.deliver("digest", bad_keys)
        self.deliver("digest", bad_rank)
        first, rank, again, rank_again = self.warnings.messages
        self.assertIn(
            "Dropped 1 malformed CacheDigest message(s) (gpu_hashes: 13 bytes, "
            "not a whole number of 8-byte keys) since the last warning of this "
            "reason; warning at most every 60 s per reason.",
            first,
        )
        self.assertIn(
            f"Dropped 1 malformed CacheDigest message(s) (dp_rank: {DP}, ", rank
        )
        # The four at t=0 after the first, the one at 59 s and this one.
        self.assertIn("Dropped 6 malformed CacheDigest message(s) (gpu_hashes: ", again)
        self.assertIn(
            "Dropped 1 malformed CacheDigest message(s) (dp_rank: ", rank_again
        )
        self.assertEqual(self.router.receiver.dropped.total["gpu_hashes"], 7)


def _sleep_forever():
    while True:
        time.sleep(60)


class TestPrivateDirectory(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_both_endpoints_in_one_private_directory_per_instance(self):
        from sglang.srt.managers.dp_routing.channel import (
            prefill_landing_endpoint,
            prefix_digest_endpoint,
        )
        from sglang.srt.managers.dp_routing.ipc_dir import routing_ipc_dir

        a, b = SimpleNamespace(instance_id="a1b2c3"), SimpleNamespace(
            instance_id="../x"
        )
        directory = routing_ipc_dir(a)
        self.assertEqual(os.path.dirname(directory), tempfile.gettempdir())
        self.assertIn("a1b2c3", os.path.basename(directory))
        self.assertEqual(prefix_digest_endpoint(a), f"ipc://{directory}/digest.sock")
        self.assertEqual(prefill_landing_endpoint(a), f"ipc://{directory}/landing.sock")
        self.assertEqual(os.path.dirname(routing_ipc_dir(b)), tempfile.gettempdir())
        self.assertNotEqual(routing_ipc_dir(b), directory)

    def test_made_private_and_an_existing_path_accepted_only_if_private(self):
        from sglang.srt.managers.dp_routing.ipc_dir import ensure_private_dir

        path = os.path.join(self.tmp, "d")
        umask = os.umask(0)
        try:
            self.assertTrue(ensure_private_dir(path))
        finally:
            os.umask(umask)
        self.assertEqual(stat.S_IMODE(os.lstat(path).st_mode), 0o700)
        self.assertFalse(ensure_private_dir(path))  # ours: taken as it is
        os.chmod(path, 0o755)
        with self.assertRaisesRegex(RuntimeError, "mode 0700.*drwxr-xr-x"):
            ensure_private_dir(path)
        other = os.path.join(self.tmp, "link")
        os.symlink(path, other)
        os.chmod(path, 0o700)
        with self.assertRaisesRegex(RuntimeError, "not a directory of this user"):
            ensure_private_dir(other)
        plain = os.path.join(self.tmp, "file")
        open(plain, "w").close()
        with self.assertRaisesRegex(RuntimeError, "not a directory of this user"):
            ensure_private_dir(plain)

    def test_removed_once_its_binder_is_killed(self):
        from sglang.srt.managers.dp_routing.ipc_dir import remove_when_exits

        path = os.path.join(self.tmp, "d")
        os.mkdir(path, 0o700)
        open(os.path.join(path, "digest.sock"), "w").close()
        proc = multiprocessing.get_context("fork").Process(target=_sleep_forever)
        proc.start()
        remove_when_exits(path, proc)
        self.assertTrue(os.path.isdir(path))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertFalse(os.path.exists(path))

    def test_launcher_makes_it_only_for_cache_aware(self):
        from sglang.srt.arg_groups.serving_hook import handle_load_balance_method
        from sglang.srt.managers.dp_routing.ipc_dir import (
            create_for_launch,
            remove_dir,
            routing_ipc_dir,
        )
        from sglang.srt.runtime_context import (
            publish,
            restore_context,
            snapshot_context,
        )
        from sglang.srt.server_args import ServerArgs

        saved = snapshot_context()
        try:
            made = {}
            for method in ("round_robin", "cache_aware"):
                server_args = ServerArgs(
                    model_path="dummy", dp_size=2, load_balance_method=method
                )
                handle_load_balance_method(server_args)
                # What the launcher's PortArgs carries of the server instance.
                port_args = SimpleNamespace(instance_id=uuid.uuid4().hex[:12])
                publish(server_args, role="tokenizer")
                path = create_for_launch(port_args)
                made[method] = (path, os.path.isdir(routing_ipc_dir(port_args)))
                if path is not None:
                    mode = stat.S_IMODE(os.lstat(path).st_mode)
                    remove_dir(path)
        finally:
            restore_context(saved)
        self.assertEqual(made["round_robin"], (None, False))
        self.assertTrue(made["cache_aware"][1], made)
        self.assertEqual(mode, 0o700)


if __name__ == "__main__":
    unittest.main()
