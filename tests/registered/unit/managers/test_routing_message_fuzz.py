"""Generated messages on the cache-aware routing sockets (hypothesis).

Thousands of payloads go over a real PUSH socket into the real
``DigestReceiver`` and ``LandingReceiver`` of a ``CacheAwareRouter`` bound in
a private directory: digests and landings with every field drawn in range or
out of it (wrong types, wrong lengths, ranks the controller does not have,
page and chunk sizes, counts, key bytes that are not whole int64 keys),
arbitrary msgpack values and random bytes. Each one is judged by a reference
check written from the message spec (``expected_digest``,
``expected_landing``), independent of the decoders: a bad one must be
dropped and counted, a good one passed on unchanged and taken by the router
(digest update, landing, then a routing decision), and nothing may raise.
The drops warn at most once per reason.
"""

import logging
import math
import os
import shutil
import tempfile
import unittest

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")
PROJECT_ONLY = "hypothesis is not one of upstream's test dependencies"

DP = 3
PAGE, CHUNK = 4, 16
INT64_MAX = (1 << 63) - 1
FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# CacheDigest on the wire: a msgpack array, 7 required fields, 5 optional.
DIGEST_FIELDS = (
    "dp_rank",
    "epoch",
    "seq",
    "page_size",
    "chunk_size",
    "timestamp",
    "available_tokens",
    "capacity_tokens",
    "gpu_hashes",
    "host_hashes",
    "is_bigram",
    "version",
)
DIGEST_DEFAULTS = {
    "capacity_tokens": 0,
    "gpu_hashes": b"",
    "host_hashes": b"",
    "is_bigram": False,
    "version": 2,
}
DIGEST_REQUIRED = len(DIGEST_FIELDS) - len(DIGEST_DEFAULTS)


def is_int(v):
    return type(v) is int


def expected_digest(fields):
    """The digest's fields if a controller with DP ranks, page and chunk size
    as here must accept it, else None (the spec, not the decoder)."""
    if not isinstance(fields, list):
        return None
    if not DIGEST_REQUIRED <= len(fields) <= len(DIGEST_FIELDS):
        return None
    d = dict(DIGEST_DEFAULTS)
    d.update(zip(DIGEST_FIELDS, fields))
    ints = set(DIGEST_FIELDS) - {"timestamp", "gpu_hashes", "host_hashes"}
    ints.discard("is_bigram")
    if not all(is_int(d[k]) for k in ints):
        return None
    if type(d["timestamp"]) not in (int, float) or not math.isfinite(d["timestamp"]):
        return None
    if type(d["is_bigram"]) is not bool:
        return None
    if not all(
        type(d[k]) is bytes and len(d[k]) % 8 == 0
        for k in ("gpu_hashes", "host_hashes")
    ):
        return None
    in_range = (
        d["version"] == 2
        and 0 <= d["dp_rank"] < DP
        and 0 <= d["epoch"] <= INT64_MAX
        and 1 <= d["seq"] <= INT64_MAX
        and 1 <= d["page_size"] <= INT64_MAX
        and d["chunk_size"] == CHUNK
        and CHUNK % d["page_size"] == 0
        and 0 <= d["available_tokens"] <= INT64_MAX
        and 0 <= d["capacity_tokens"] <= INT64_MAX
    )
    return d if in_range else None


def expected_landing(fields):
    if not isinstance(fields, list) or len(fields) != 3:
        return None
    rank, rids, upto = fields
    if not (is_int(rank) and 0 <= rank < DP):
        return None
    if not (isinstance(rids, list) and isinstance(upto, list)):
        return None
    if not rids or len(rids) != len(upto):
        return None
    if not all(type(r) is str and r for r in rids):
        return None
    if not all(is_int(u) and 1 <= u <= INT64_MAX for u in upto):
        return None
    return {"dp_rank": rank, "rids": rids, "upto": upto}


# ---- strategies ----------------------------------------------------------

EDGE_INTS = [
    0,
    1,
    -1,
    2,
    3,
    7,
    8,
    16,
    32,
    INT64_MAX,
    INT64_MAX + 1,
    -(1 << 63),
    (1 << 64) - 1,
]
any_int = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(1 << 63), (1 << 64) - 1))
key_bytes = st.lists(st.integers(-(1 << 63), INT64_MAX), max_size=12).map(
    lambda keys: b"".join(k.to_bytes(8, "little", signed=True) for k in keys)
)
scalar = st.one_of(
    st.none(),
    st.booleans(),
    any_int,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=20),
)
msgpack_value = st.recursive(
    scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.text(max_size=4), inner, max_size=4),
    ),
    max_leaves=16,
)

GOOD = {
    "dp_rank": st.integers(0, DP - 1),
    "epoch": st.integers(0, (1 << 62) - 1),
    "seq": st.integers(1, 1 << 40),
    "page_size": st.sampled_from([1, 2, 4, 8, 16]),
    "chunk_size": st.just(CHUNK),
    "timestamp": st.floats(0, 2e9),
    "available_tokens": st.integers(0, 1 << 40),
    "capacity_tokens": st.integers(0, 1 << 40),
    "gpu_hashes": key_bytes,
    "host_hashes": key_bytes,
    "is_bigram": st.booleans(),
    "version": st.just(2),
}
# Mostly a value of the right type out of range, else any type.
BAD = {
    name: st.one_of(any_int, any_int, any_int, scalar)
    for name in DIGEST_FIELDS
    if name not in ("gpu_hashes", "host_hashes", "timestamp", "is_bigram")
}
BAD["gpu_hashes"] = BAD["host_hashes"] = st.one_of(
    st.binary(max_size=40), st.binary(max_size=40), scalar
)
BAD["timestamp"] = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), scalar)
BAD["is_bigram"] = scalar


@st.composite
def digest_fields(draw):
    """A digest's fields, up to three of them drawn from anything, and
    sometimes cut short or with an extra field."""
    broken = draw(st.sets(st.sampled_from(DIGEST_FIELDS), max_size=3))
    fields = [
        draw(BAD[name] if name in broken else GOOD[name]) for name in DIGEST_FIELDS
    ]
    cut = draw(st.sampled_from([len(DIGEST_FIELDS)] * 12 + [0, 5, 6, 7, 9, 11, 13]))
    if cut > len(fields):
        fields.append(draw(scalar))
    else:
        fields = fields[:cut]
    return fields


RIDS = ["r0", "r1", "r2", "r3"]


@st.composite
def landing_fields(draw):
    """A landing of 1-5 requests, up to two of its parts broken."""
    broken = draw(
        st.sets(
            st.sampled_from(["rank", "rid", "upto", "counts", "rids", "shape"]),
            max_size=2,
        )
    )
    n = draw(st.integers(1, 5))
    rank = draw(st.one_of(any_int, scalar) if "rank" in broken else GOOD["dp_rank"])
    rids = draw(st.lists(st.sampled_from(RIDS), min_size=n, max_size=n))
    upto = draw(st.lists(st.integers(1, 200), min_size=n, max_size=n))
    if "rid" in broken:
        rids[draw(st.integers(0, n - 1))] = draw(st.one_of(st.just(""), scalar))
    if "upto" in broken:
        upto[draw(st.integers(0, n - 1))] = draw(st.one_of(any_int, scalar))
    if "counts" in broken:
        how = draw(st.sampled_from(["short", "long", "empty"]))
        if how == "empty":
            rids, upto = [], []
        else:
            upto = upto[:-1] if how == "short" else upto + [1]
    if "rids" in broken:
        rids = draw(scalar)
    fields = [rank, rids, upto]
    if "shape" in broken:
        fields = fields[:2] if draw(st.booleans()) else fields + [draw(scalar)]
    return fields


def encode(value):
    return msgspec.msgpack.encode(value)


# ---- the router under test ------------------------------------------------


class RoutingSockets:
    """A router with real receivers on real sockets in a private directory,
    credit on landing, and a PUSH socket into each receiver."""

    def __init__(self):
        import zmq
        from sglang.srt.managers.data_parallel_controller import DPBudget
        from sglang.srt.managers.dp_routing.channel import (
            DigestReceiver,
            LandingReceiver,
        )
        from sglang.srt.managers.dp_routing.ipc_dir import ensure_private_dir
        from sglang.srt.managers.dp_routing.router import CacheAwareRouter

        self.dir = os.path.join(tempfile.mkdtemp(), "routing")
        ensure_private_dir(self.dir)
        self.ctx = zmq.Context()
        digests = DigestReceiver(
            self.ctx, f"ipc://{self.dir}/digest.sock", num_ranks=DP, chunk_size=CHUNK
        )
        landings = LandingReceiver(
            self.ctx, f"ipc://{self.dir}/landing.sock", num_ranks=DP
        )
        for receiver in (digests, landings):  # no warning ends the fuzz run
            receiver.dropped.interval = 3600.0
        self.router = CacheAwareRouter(
            num_dp_ranks=DP,
            max_extra_reqs=4,
            digest_max_age=3600.0,
            pending_ttl=3600.0,
            receiver=digests,
            credit_on_landing=True,
            landing_receiver=landings,
            ipc_dir=self.dir,
        )
        self.budget = DPBudget(DP)
        self.push = {}
        for name in ("digest", "landing"):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{self.dir}/{name}.sock")
            self.push[name] = s

    def deliver(self, name, payload, timeout_ms=10_000):
        """Sends ``payload`` and returns what the receiver passes on of it."""
        receiver = {
            "digest": self.router.receiver,
            "landing": self.router.landing_receiver,
        }[name]
        self.push[name].send(payload)
        if not receiver.socket.poll(timeout_ms):
            raise AssertionError(f"{name} payload not delivered within {timeout_ms} ms")
        return list(receiver.drain())

    def route(self, rid, tokens):
        from sglang.srt.managers.dp_routing.request import RoutedRequest

        return self.router.select(
            RoutedRequest(tokens, rid=rid), self.budget, list(range(DP))
        )

    def close(self):
        for s in self.push.values():
            s.close()
        self.router.close()
        self.ctx.term()
        shutil.rmtree(os.path.dirname(self.dir), ignore_errors=True)


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class TestRoutingMessageFuzz(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.sockets = RoutingSockets()
        cls.prompt = list(range(1, 4 * CHUNK + 1))
        # In flight on ranks with a digest: the rids the generated landings
        # name.
        for rank in range(DP):
            fields = [rank, 1, 1, PAGE, CHUNK, 0.0, 1000]
            cls.sockets.deliver("digest", encode(fields))
        for rid in RIDS:
            cls.sockets.route(rid, cls.prompt)
        cls.warnings = Warnings()
        logging.getLogger("sglang.srt.managers.dp_routing").addHandler(cls.warnings)
        cls.counts = {"digest": [0, 0], "landing": [0, 0]}

    @classmethod
    def tearDownClass(cls):
        logging.getLogger("sglang.srt.managers.dp_routing").removeHandler(cls.warnings)
        print(f"accepted, dropped: {cls.counts}")
        for receiver in (
            cls.sockets.router.receiver,
            cls.sockets.router.landing_receiver,
        ):
            print(f"{receiver.message_name} drops: {dict(receiver.dropped.total)}")
        cls.sockets.close()

    def check_digest(self, payload, fields):
        receiver = self.sockets.router.receiver
        dropped = sum(receiver.dropped.total.values())
        got = self.sockets.deliver("digest", payload)
        want = expected_digest(fields)
        if want is None:
            self.assertEqual(got, [], fields)
            self.assertEqual(sum(receiver.dropped.total.values()), dropped + 1)
            self.counts["digest"][1] += 1
            return
        self.assertEqual(len(got), 1, fields)
        self.assertEqual(msgspec.structs.asdict(got[0]), want)
        self.counts["digest"][0] += 1
        self.sockets.router.update_digest(got[0])
        rank = self.sockets.route(None, self.prompt).rank
        self.assertIn(rank, range(DP))

    def check_landing(self, payload, fields):
        receiver = self.sockets.router.landing_receiver
        dropped = sum(receiver.dropped.total.values())
        got = self.sockets.deliver("landing", payload)
        want = expected_landing(fields)
        if want is None:
            self.assertEqual(got, [], fields)
            self.assertEqual(sum(receiver.dropped.total.values()), dropped + 1)
            self.counts["landing"][1] += 1
            return
        self.assertEqual(len(got), 1, fields)
        self.assertEqual(msgspec.structs.asdict(got[0]), want)
        self.counts["landing"][0] += 1
        self.sockets.router.on_landed(got[0])

    @FUZZ
    @given(digest_fields())
    # The reports: key bytes that are not whole int64 keys, chunk size 0, a
    # negative page size.
    @example([0, 1, 1, PAGE, CHUNK, 0.0, 10, 0, b"\x00" * 13, b"", False, 2])
    @example([1, 1, 1, PAGE, 0, 0.0, 10])
    @example([1, 1, 1, -PAGE, CHUNK, 0.0, 10])
    @example([2, 1, 1, PAGE, CHUNK, 0.0, 10, 0, b"", b"\x01" * 9])
    @example([2, 1, 1, PAGE, CHUNK, 0.0, -5])
    @example([2, 1, 1, PAGE, CHUNK, 0.0, 5, -1])
    def fuzz_digests(self, fields):
        self.check_digest(encode(fields), fields)

    @FUZZ
    @given(landing_fields())
    @example([7, ["r0"], [10]])  # a rank the controller does not have
    @example([0, ["r0", "r1"], [10]])
    @example([0, [], []])
    @example([0, ["r0"], [0]])
    def fuzz_landings(self, fields):
        self.check_landing(encode(fields), fields)

    @settings(FUZZ, max_examples=400)
    @given(st.one_of(msgpack_value, st.lists(msgpack_value, min_size=3, max_size=13)))
    def fuzz_any_msgpack(self, value):
        payload = encode(value)
        self.check_digest(payload, value)
        self.check_landing(payload, value)

    @FUZZ
    @given(st.binary(max_size=120))
    def fuzz_random_bytes(self, payload):
        try:
            value = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            value = None  # not msgpack: nothing to accept
        self.check_digest(payload, value)
        self.check_landing(payload, value)

    def test_every_message_fuzzed_then_each_case_kind_seen_and_warned_once(self):
        # The four fuzz runs in this order, on one router (no test depends
        # on another's order): each generated message is judged where it is
        # sent; then the runs together drew accepted and dropped messages of
        # both kinds, and warned once per reason.
        self.fuzz_digests()
        self.fuzz_landings()
        self.fuzz_any_msgpack()
        self.fuzz_random_bytes()
        for kind in ("digest", "landing"):
            accepted, dropped = self.counts[kind]
            self.assertGreater(accepted, 100, (kind, self.counts))
            self.assertGreater(dropped, 1000, (kind, self.counts))
        reasons = {
            name: set(receiver.dropped.total)
            for name, receiver in (
                ("CacheDigest", self.sockets.router.receiver),
                ("PrefillLanded", self.sockets.router.landing_receiver),
            )
        }
        digest_reasons = {"version", "dp_rank", "epoch", "seq", "page_size"}
        digest_reasons |= {"chunk_size", "timestamp", "available_tokens"}
        digest_reasons |= {"capacity_tokens", "gpu_hashes", "host_hashes"}
        self.assertEqual(reasons["CacheDigest"], digest_reasons | {"shape", "msgpack"})
        self.assertEqual(
            reasons["PrefillLanded"], {"shape", "msgpack", "dp_rank", "rids", "upto"}
        )
        warned = self.warnings.messages
        self.assertEqual(len(warned), sum(len(r) for r in reasons.values()), warned)
        for name, rs in reasons.items():
            for reason in rs:
                hits = [
                    m
                    for m in warned
                    if f"malformed {name} " in m and f"({reason}: " in m
                ]
                self.assertEqual(len(hits), 1, (name, reason, warned))


if __name__ == "__main__":
    unittest.main()
