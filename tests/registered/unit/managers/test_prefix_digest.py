"""Prefix digests for cache-aware DP routing against real radix trees.

The digest must name exactly what a rank's ``UnifiedRadixCache`` can serve:
its hashes are the KV-event page hashes (bit for bit, on the Python and the
Rust tree core), kept at chunk boundaries, in the request's cache namespace;
``PrefixDigestTracker`` follows inserts, device eviction, write-back to a real
HiCache host tier and host eviction; the oracle is the tree's own
``match_prefix``.
"""

import random
import unittest

import msgspec
from sglang.test.ci.ci_register import register_cpu_ci

from harness.dp_routing_fixtures import (
    estimate_prefix_match,
    page_hash_digests,
    request_page_hashes,
    require_cache_aware_routing,
)
from harness.stacks.radix_tree_fixtures import (
    build_tree,
    enable_hicache,
    evict,
    insert,
    match,
)

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "TestReferenceHasher.test_matches_upstream_hash_str": "checks this test's "
    "reference hasher against upstream's get_hash_str, which the PR leaves as is",
}

BACKENDS = ("python", "rust")


def _event_hashes(events):
    return [h for e in events for h in getattr(e, "block_hashes", ())]


def _floor(n, unit):
    return n // unit * unit


class TestReferenceHasher(unittest.TestCase):
    """This test's reference page hasher (``page_hash_digests``) is
    upstream's ``get_hash_str``: what the digest checks below compare with."""

    def test_matches_upstream_hash_str(self):
        from sglang.srt.mem_cache.utils import get_hash_str

        tokens = list(range(5, 69)) + [2**32 + 3, 9, 9, 9]
        for page_size in (1, 4, 16):
            full = tokens[: len(tokens) // page_size * page_size]
            ours = [d.hex() for d in page_hash_digests(tokens, page_size)]
            self.assertEqual(ours, get_hash_str(full, None, page_size))


class _DigestTest(unittest.TestCase):
    def setUp(self):
        require_cache_aware_routing()


class TestDigestHashes(_DigestTest):
    def test_page_hashes_equal_kv_event_hashes(self):
        from sglang.srt.managers.dp_routing.chunk_keys import RequestNamespace

        rng = random.Random(7)
        for backend in BACKENDS:
            for page_size in (1, 4, 16):
                tree = build_tree(page_size, backend)
                tree.cache.take_events()
                for salt in (None, "tenant-a"):
                    tokens = [rng.randrange(0, 150000) for _ in range(70)]
                    insert(tree, tokens, cache_salt=salt)
                    events = tree.cache.take_events()
                    expected = request_page_hashes(
                        tokens, page_size, RequestNamespace.of(cache_salt=salt)
                    )
                    with self.subTest(backend=backend, page=page_size, salt=salt):
                        self.assertEqual(len(expected), 70 // page_size)
                        self.assertEqual(_event_hashes(events), expected)

    def test_first_page_hash_is_the_first_event_hash(self):
        from array import array

        from sglang.srt.managers.dp_routing.chunk_keys import (
            RequestNamespace,
            first_page_hash,
        )

        tokens = list(range(7, 71))
        for ns in (
            RequestNamespace(),
            RequestNamespace.of(cache_salt="s"),
            RequestNamespace.of(extra_key="k"),
            RequestNamespace.of(lora_id="a" * 32, lora_name="x"),
        ):
            for page in (1, 4, 16):
                raw = array("I", tokens).tobytes()
                self.assertEqual(
                    first_page_hash(raw, page, ns),
                    request_page_hashes(tokens, page, ns)[0],
                )

    def test_tracker_keys_equal_request_keys(self):
        # The keys a rank derives from its tree's events (parents, token ids)
        # are the keys the controller computes from a request's tokens, on
        # both tree cores, page sizes and namespaces; prefixes branching
        # inside a chunk and pages with a non-u32 token included.
        from sglang.srt.managers.dp_routing.chunk_keys import (
            RequestChunks,
            RequestNamespace,
            tree_extra_key,
        )
        from sglang.srt.managers.dp_routing.digest import unpack_hashes
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        lora_id = "0123456789abcdef0123456789abcdef"
        named = tree_extra_key(None, lora_id)
        spaces = (
            {},
            {"cache_salt": "tenant-a"},
            {"extra_key": "plain-key"},
            {"lora_id": lora_id, "lora_name": "adapter-x"},
        )
        rng = random.Random(3)
        for backend in BACKENDS:
            for page, chunk in ((1, 8), (4, 16), (16, 32)):
                tree = build_tree(
                    page, backend, kv_size=1 << 14, lora_names={named: "adapter-x"}
                )
                tree.cache.take_events()
                tracker = PrefixDigestTracker(page_size=page, chunk_size=chunk)
                want = set()
                base = [rng.randrange(1, 150000) for _ in range(3 * chunk)]
                for trial in range(12):
                    ns = spaces[trial % len(spaces)]
                    cut = rng.randrange(len(base))
                    seq = base[:cut] + [
                        rng.randrange(1, 150000) for _ in range(rng.randrange(90))
                    ]
                    if trial % 5 == 4:
                        seq[rng.randrange(len(seq))] = 2**33
                    insert(
                        tree,
                        seq,
                        cache_salt=ns.get("cache_salt"),
                        extra_key=tree_extra_key(
                            ns.get("extra_key"), ns.get("lora_id")
                        ),
                    )
                    tracker.apply(tree.cache.take_events())
                    wide = [i for i, t in enumerate(seq) if t >= 2**32]
                    usable = seq[: wide[0]] if wide else seq
                    want.update(
                        RequestChunks(
                            usable, page, chunk, RequestNamespace.of(**ns)
                        ).keys
                    )
                with self.subTest(backend=backend, page=page):
                    self.assertEqual(unpack_hashes(tracker.build()[0]), want)
        self.assertEqual(
            RequestChunks([1] * 7 + [2**33], 1, 4, RequestNamespace()).keys, []
        )

    def test_one_sha256_per_chunk(self):
        # The controller's cost per request does not grow with 1 / page size:
        # one SHA-256 for the first page and one per chunk.
        from unittest import mock

        from sglang.srt.managers.dp_routing import chunk_keys as ck

        calls = []
        real = ck.hashlib.sha256

        def counted(*args):
            calls.append(1)
            return real(*args)

        tokens = list(range(1, 1030))
        with mock.patch.object(ck.hashlib, "sha256", side_effect=counted):
            keys = ck.RequestChunks(tokens, 1, 256, ck.RequestNamespace()).keys
        self.assertEqual((len(keys), len(calls)), (4, 5))

    def test_lora_namespace_matches_events(self):
        from sglang.srt.managers.dp_routing.chunk_keys import (
            RequestNamespace,
            tree_extra_key,
        )

        lora_id = "0123456789abcdef0123456789abcdef"
        key = tree_extra_key("user-key", lora_id)
        for backend in BACKENDS:
            tree = build_tree(4, backend, lora_names={key: "adapter-x"})
            tree.cache.take_events()
            tokens = list(range(1000, 1032))
            insert(tree, tokens, extra_key=key)
            events = _event_hashes(tree.cache.take_events())
            ns = RequestNamespace.of(
                extra_key="user-key", lora_id=lora_id, lora_name="adapter-x"
            )
            with self.subTest(backend=backend):
                self.assertEqual(events, request_page_hashes(tokens, 4, ns))
                base = request_page_hashes(tokens, 4, RequestNamespace())
                self.assertTrue(set(base).isdisjoint(events))


class TestDigestTracker(_DigestTest):
    def _estimate(self, tracker, tokens, page, chunk, **ns):
        from sglang.srt.managers.dp_routing.chunk_keys import (
            RequestChunks,
            RequestNamespace,
        )
        from sglang.srt.managers.dp_routing.digest import unpack_hashes

        gpu, host = (unpack_hashes(b) for b in tracker.build())
        chunks = RequestChunks(tokens, page, chunk, RequestNamespace.of(**ns))
        return estimate_prefix_match(chunks, gpu, host)

    def test_chunk_alignment_and_dirty_flag(self):
        from sglang.srt.managers.dp_routing.digest import unpack_hashes
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        with self.assertRaisesRegex(ValueError, "multiple of the tree page size"):
            PrefixDigestTracker(page_size=4, chunk_size=6)
        tree = build_tree(4, "python")
        tree.cache.take_events()
        tracker = PrefixDigestTracker(page_size=4, chunk_size=8)
        tracker.build()
        self.assertFalse(tracker.dirty)
        built = tracker.build()
        self.assertIs(tracker.build(), built)  # not rebuilt while clean
        insert(tree, [1, 2, 3, 4])  # one page: no chunk boundary
        tracker.apply(tree.cache.take_events())
        self.assertFalse(tracker.dirty)
        self.assertEqual(tracker.build(), (b"", b""))
        insert(tree, list(range(1, 21)))  # pages 2..5: boundaries at 8 and 16
        tracker.apply(tree.cache.take_events())
        self.assertTrue(tracker.dirty)
        gpu = unpack_hashes(tracker.build()[0])
        self.assertEqual(len(gpu), 2)
        m = self._estimate(tracker, list(range(1, 30)), 4, 8)
        self.assertEqual((m.gpu_len, m.total_len), (16, 16))
        m = self._estimate(tracker, list(range(1, 15)) + [99] * 10, 4, 8)
        self.assertEqual(m.total_len, 8)

    def test_namespace_isolation(self):
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        lora_id = "0123456789abcdef0123456789abcdef"
        for backend in BACKENDS:
            tree = build_tree(4, backend, lora_names={lora_id: "adapter"})
            tree.cache.take_events()
            tracker = PrefixDigestTracker(page_size=4, chunk_size=8)
            tokens = list(range(300, 340))
            insert(tree, tokens, cache_salt="salt-a")
            insert(tree, tokens, extra_key=lora_id)
            tracker.apply(tree.cache.take_events())
            with self.subTest(backend=backend):
                est = self._estimate
                self.assertEqual(
                    est(tracker, tokens, 4, 8, cache_salt="salt-a").total_len, 40
                )
                self.assertEqual(
                    est(tracker, tokens, 4, 8, cache_salt="salt-b").total_len, 0
                )
                self.assertEqual(est(tracker, tokens, 4, 8).total_len, 0)
                self.assertEqual(
                    est(
                        tracker, tokens, 4, 8, lora_id=lora_id, lora_name="adapter"
                    ).total_len,
                    40,
                )
                self.assertEqual(
                    est(
                        tracker, tokens, 4, 8, lora_id="f" * 32, lora_name="other"
                    ).total_len,
                    0,
                )

    def test_plain_extra_keys_do_not_share_hashes(self):
        # The same tokens under two plain extra_keys (no LoRA name), none, and
        # an unnamed LoRA: four namespaces whose event hashes collide, kept
        # apart in the digest through the extra_key the events carry; a
        # removal leaves the other namespaces' prefixes in place.
        from sglang.srt.disaggregation.kv_events import BlockStored
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        lora_id = "0123456789abcdef0123456789abcdef"
        tokens = list(range(500, 540))
        for backend in BACKENDS:
            with self.subTest(backend=backend):
                tree = build_tree(4, backend)
                tree.cache.take_events()
                tracker = PrefixDigestTracker(page_size=4, chunk_size=8)
                insert(tree, tokens, extra_key="tenant-a")
                insert(tree, tokens, extra_key=lora_id)
                events = tree.cache.take_events()
                stored = [e for e in events if isinstance(e, BlockStored)]
                self.assertEqual({e.extra_key for e in stored}, {"tenant-a", lora_id})
                tracker.apply(events)
                est = self._estimate
                self.assertEqual(
                    est(tracker, tokens, 4, 8, extra_key="tenant-a").total_len, 40
                )
                self.assertEqual(
                    est(tracker, tokens, 4, 8, extra_key="tenant-b").total_len, 0
                )
                self.assertEqual(est(tracker, tokens, 4, 8).total_len, 0)
                self.assertEqual(
                    est(tracker, tokens, 4, 8, lora_id=lora_id).total_len, 40
                )
                insert(tree, tokens)  # no namespace
                tracker.apply(tree.cache.take_events())
                self.assertEqual(est(tracker, tokens, 4, 8).total_len, 40)
                # Evict everything: every namespace's removal lands on its own.
                evict(tree, 10**6)
                tracker.apply(tree.cache.take_events())
                self.assertEqual(tracker.build(), (b"", b""))

    def test_events_carry_no_extra_key_unless_routing_asks(self):
        # Flag off: the events are upstream's (extra_key absent from the wire).
        from sglang.srt.disaggregation.kv_events import BlockStored

        for backend in BACKENDS:
            with self.subTest(backend=backend):
                tree = build_tree(4, backend, record_extra_keys=False)
                tree.cache.take_events()
                insert(tree, list(range(600, 640)), extra_key="tenant-a")
                stored = [
                    e for e in tree.cache.take_events() if isinstance(e, BlockStored)
                ]
                self.assertTrue(stored)
                self.assertEqual({e.extra_key for e in stored}, {None})
                self.assertNotIn(b"extra_key", msgspec.msgpack.encode(stored[0]))

    def test_follows_inserts_and_eviction_like_the_tree(self):
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        page, chunk = 4, 8
        for backend in BACKENDS:
            rng = random.Random(11)
            tree = build_tree(page, backend, kv_size=512)
            tree.cache.take_events()
            tracker = PrefixDigestTracker(page_size=page, chunk_size=chunk)
            prompts = [
                [rng.randrange(50) for _ in range(rng.randrange(8, 40))]
                for _ in range(6)
            ]
            seqs = []
            for step in range(120):
                base = rng.choice(prompts)
                seq = base + [rng.randrange(1000) for _ in range(rng.randrange(0, 60))]
                seqs.append(seq)
                insert(tree, seq)
                if step % 7 == 0:
                    evict(tree, rng.randrange(16, 200))
                tracker.apply(tree.cache.take_events())
                for probe in rng.sample(seqs, min(4, len(seqs))):
                    probe = probe + [5000]
                    want = _floor(match(tree, probe).device_prefix_len, chunk)
                    got = self._estimate(tracker, probe, page, chunk)
                    with self.subTest(backend=backend, step=step):
                        self.assertEqual((got.gpu_len, got.total_len), (want, want))

    def test_host_tier_and_reset(self):
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        page, chunk = 4, 8
        for backend in BACKENDS:
            tree = build_tree(page, backend)
            enable_hicache(tree)
            tree.cache.take_events()
            tracker = PrefixDigestTracker(page_size=page, chunk_size=chunk)
            tokens = list(range(100, 132))
            insert(tree, tokens)
            tracker.apply(tree.cache.take_events())
            probe = tokens + [1]
            with self.subTest(backend=backend, stage="gpu"):
                m = self._estimate(tracker, probe, page, chunk)
                self.assertEqual((m.gpu_len, m.total_len), (32, 32))
            evict(tree, 32)  # write-back: backed up to host, freed on device
            tracker.apply(tree.cache.take_events())
            tm = match(tree, probe)
            self.assertEqual((tm.device_prefix_len, tm.host_hit_length), (0, 32))
            with self.subTest(backend=backend, stage="host"):
                m = self._estimate(tracker, probe, page, chunk)
                self.assertEqual((m.gpu_len, m.host_len), (0, 32))
            tree.cache.evict_host(32)
            tracker.apply(tree.cache.take_events())
            with self.subTest(backend=backend, stage="host evicted"):
                self.assertEqual(
                    self._estimate(tracker, probe, page, chunk).total_len, 0
                )
            insert(tree, tokens)
            tracker.apply(tree.cache.take_events())
            self.assertEqual(self._estimate(tracker, probe, page, chunk).total_len, 32)
            tree.cache.reset()  # flush_cache
            tracker.apply(tree.cache.take_events())
            with self.subTest(backend=backend, stage="reset"):
                self.assertTrue(tracker.dirty)
                self.assertEqual(tracker.build(), (b"", b""))


class TestDigestIndex(_DigestTest):
    def test_one_walk_for_all_ranks_equals_each_rank_and_its_tree(self):
        """The router's walk (every rank at once, from ``DigestIndex``) gives
        each rank what the single-rank walk and the rank's own tree give,
        while the trees insert, evict to host and evict; with pending keys on
        some ranks it equals the single-rank walk with those keys."""
        from sglang.srt.managers.dp_routing.chunk_keys import (
            RequestChunks,
            RequestNamespace,
        )
        from sglang.srt.managers.dp_routing.digest import unpack_hashes
        from sglang.srt.managers.dp_routing.index import (
            DigestIndex,
            estimate_prefix_matches,
        )
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        page, chunk, dp = 4, 8, 6
        rng = random.Random(23)
        trees, trackers = [], []
        for r in range(dp):
            tree = build_tree(page, "python", kv_size=256)
            if r % 2:
                enable_hicache(tree)
            tree.cache.take_events()
            trees.append(tree)
            trackers.append(PrefixDigestTracker(page_size=page, chunk_size=chunk))
        index = DigestIndex()
        prompts = [[rng.randrange(50) for _ in range(24)] for _ in range(4)]
        seqs = []
        for step in range(80):
            r = rng.randrange(dp)
            seq = rng.choice(prompts) + [rng.randrange(1000) for _ in range(20)]
            seqs.append(seq)
            insert(trees[r], seq)
            if step % 5 == 0:
                evict(trees[r], rng.randrange(16, 160))
            trackers[r].apply(trees[r].cache.take_events())
            sets = [tuple(unpack_hashes(b) for b in t.build()) for t in trackers]
            index.update(r, *sets[r])
            fresh = DigestIndex()
            for q in range(dp):
                fresh.update(q, *sets[q])
            self.assertEqual((index.gpu, index.host), (fresh.gpu, fresh.host))
            for probe in rng.sample(seqs, min(3, len(seqs))):
                chunks = RequestChunks(probe + [7], page, chunk, RequestNamespace())
                ranks = rng.randrange(1, 1 << dp)
                pending = {}
                if step % 3 == 0:
                    for key in rng.sample(chunks.keys, min(2, len(chunks.keys))):
                        pending[key] = rng.randrange(1 << dp)
                got = estimate_prefix_matches(chunks, index, ranks, pending)
                self.assertEqual(sorted(got), [q for q in range(dp) if ranks >> q & 1])
                for q, m in got.items():
                    keys = {k for k, mask in pending.items() if mask >> q & 1}
                    one = estimate_prefix_match(chunks, *sets[q], keys)
                    with self.subTest(step=step, rank=q):
                        self.assertEqual(
                            (m.gpu_len, m.total_len), (one.gpu_len, one.total_len)
                        )
                        if not keys:
                            tm = match(trees[q], probe + [7])
                            device = tm.device_prefix_len
                            self.assertEqual(
                                (m.gpu_len, m.total_len),
                                (
                                    _floor(device, chunk),
                                    _floor(device + tm.host_hit_length, chunk),
                                ),
                            )
        for q in range(dp):
            index.remove(q)
        self.assertEqual((index.gpu, index.host), ({}, {}))


if __name__ == "__main__":
    unittest.main()
