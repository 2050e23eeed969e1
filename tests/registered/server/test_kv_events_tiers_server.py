"""KV events of the host tier on a running server (CPU, tiny local models).

With ``--kv-events-config`` (the ``zmq`` publisher bound on 127.0.0.1, topic
``kv``) a server publishes ``KVEventBatch`` messages, multipart ``[topic,
seq (8 bytes, big endian), msgpack payload]``, the payload an array ``[ts,
events, attn_dp_rank]`` of tagged maps (``type`` = ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``).  With HiCache the tree records the
host tier too (``unified_tree_core.py``, and alike its Rust twin, the default
core): a write-through backup that lands
is a ``BlockStored`` with ``medium`` ``CPU_PINNED`` (``finish_write_through``),
a device eviction of a backed-up node a ``BlockRemoved`` ``GPU`` (``_demote``;
the node stays host-only), a load-back a ``BlockStored`` ``GPU``
(``commit_load_back``).  A consumer (SMG's event-driven router, Dynamo)
decodes the payload itself, so the test does too (``msgspec`` on the raw
bytes, no sglang class): what is checked is what such a router receives.

A SUB socket connects before the server starts (ZMQ reconnects until the
publisher binds), so it sees every event of the workload: prompt A, fillers
that push A out of the device pool (its node is written through first, so it
is demoted, not dropped), then A again with new tokens after it (its prefix is
loaded back from the host tier; ``cached_tokens_details.host``).  Prompts are
``input_ids`` of whole pages, so each page of A is one block whose
``token_ids`` the test knows; A's blocks are found by their tokens and parent
links.

Checks, per server:

* each of A's ``len(A) / page`` blocks has exactly the history
  ``Stored GPU, Stored CPU_PINNED, Removed GPU, Stored GPU``: one event per
  block and transition, the host copy under the same hash and parent chain
  as the device copy, its tokens the page's;
* every block the workload touched alternates Stored/Removed per medium (no
  transition reported twice), the revisit's new page chains to A's last block;
* one publisher: ``seq`` contiguous, every batch ``attn_dp_rank`` 0.

The tree core records the events: by default the Rust one
(``rust_tree_core/adapter.py``: the binding's tagged tuples become the same
``BlockStored`` / ``BlockRemoved``); each server's log names the core of
every rank.

Servers, side by side: (a) plain HiCache, tiny Llama, TP 1, a 1536-token
device pool, page 16, ``--hicache-ratio 4``: A is 256 tokens = 16 blocks,
four 400-token fillers; (b) tiny DeepSeek-V3.2 (MLA + DSA indexer) at
``--tp 2`` with the rank-sharded host tier
(``SGLANG_ENABLE_HICACHE_RANK_SHARD=1``; both ranks log the layers they
own), a 1024-token pool per rank, page 64, ``--hicache-ratio 2``: A is 256
tokens = 4 blocks, three 400-token fillers.  Both TP ranks hold every block
(each its own layers of the host copy) and only attention-TP rank 0
records: the TP=2 histories must be (a)'s, once per block, not once per
rank.  (The Python tree core, ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=
python``, and the replicated TP=2 server gave the same histories block for
block when this test was written; not served here, to keep its two cores'
time.)

Negative control: ``kv-events-without-host-tier-live``
(``scripts/negative_controls.py``: the Rust core's recorder drops every
``CPU_PINNED`` event): A's histories, the tail's host copy and the host
copy of every block fail; the host hits and the publisher still pass.

Not covered: decode HiCache (a PD pair over mooncake, see
``test_pd_decode_hicache_server.py``); its decode tree is the same
``UnifiedRadixCache`` with the same recording calls.
"""

import concurrent.futures
import re
import time
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.kv_events import (
    CPU,
    GPU,
    REMOVED,
    STORED,
    Subscriber,
    alternation_errors,
    blocks,
    events_config,
    publisher_port,
)
from harness.live_server import HICACHE_ARGS, LiveServer, assert_all_gone, greedy
from harness.live_workloads import conversations

register_cpu_ci(est_time=240, suite="base-b-test-cpu")
FEATURE_GROUP = "series"  # the series group it tests (or "series")
PROJECT_ONLY = "runs this project's CPU server (stand-ins, local tiny model)"

# A block's whole life in the workload: stored on the device by A's prefill,
# backed up (write-through lands), demoted by the fillers, loaded back by
# the revisit.
EXPECTED_A = [(STORED, GPU), (STORED, CPU), (REMOVED, GPU), (STORED, GPU)]
NEW_TOKENS = 4

PLAIN = dict(
    model="tiny-llama",
    page=16,
    args=["--page-size", "16", "--max-total-tokens", "1536"]
    + HICACHE_ARGS
    + ["--hicache-ratio", "4"],
    seed=101,
    prompt=256,  # 16 blocks
    fillers=4,  # 1600 tokens > the 1536-token pool
)
TP2 = dict(
    model="tiny-dsa",
    page=64,
    args=["--tp", "2", "--page-size", "64", "--max-total-tokens", "1024"]
    + HICACHE_ARGS
    + ["--hicache-ratio", "2"],
    seed=202,
    prompt=256,  # 4 blocks
    fillers=3,  # 1200 tokens > the 1024-token pool of a rank
)
SERVERS = {
    "plain": dict(PLAIN, env={}, core="RustUnifiedTreeCore"),
    "rank-shard": dict(
        TP2, env={"SGLANG_ENABLE_HICACHE_RANK_SHARD": "1"}, core="RustUnifiedTreeCore"
    ),
}
FILLER_TOKENS = 400


def chain(stores, ids: list[int], page: int) -> list:
    """The block hashes of ``ids``' whole pages, by tokens and parent links
    (from the root), as stored on the device."""
    out, parent = [], None
    for i in range(len(ids) // page):
        key = (parent, tuple(ids[i * page : (i + 1) * page]))
        gpu = {h for h, m in stores.get(key, []) if m == GPU}
        assert len(gpu) == 1, (i, gpu, stores.get(key))
        parent = gpu.pop()
        out.append(parent)
    return out


def one(server, ids):
    r = server.generate({"input_ids": ids, "sampling_params": greedy(NEW_TOKENS)})
    meta = r["meta_info"]
    return dict(
        cached=meta["cached_tokens"],
        details=meta.get("cached_tokens_details") or {},
        prompt=meta["prompt_tokens"],
    )


def serve(name: str) -> dict:
    spec = SERVERS[name]
    page = spec["page"]
    port = publisher_port()
    config = events_config(port)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")  # before the server binds
    t0 = time.monotonic()
    server = LiveServer(
        "patched",
        spec["args"] + ["--kv-events-config", config],
        env=spec["env"],
        name=f"kv-events-{name}",
        model=spec["model"],
    )
    t1 = time.monotonic()
    try:
        seed = spec["seed"]
        a = conversations(1, seed=seed, first=spec["prompt"])[0]
        fillers = conversations(spec["fillers"], seed=seed + 1, first=FILLER_TOKENS)
        revisit = a + conversations(1, seed=seed + 2, first=page)[0]
        out = dict(page=page, a=a, revisit=revisit, requests=[one(server, a)])

        def backed_up(n=None):
            history, _, _ = blocks(sub.records, page)
            copies = sum((STORED, CPU) in v for v in history.values())
            return copies >= n if n is not None else copies == len(history)

        # A's write-through lands before the fillers come
        out["settled"] = [sub.settle(lambda: backed_up(spec["prompt"] // page))]
        out["requests"] += [one(server, f) for f in fillers]
        out["settled"].append(sub.settle())
        out["requests"].append(one(server, revisit))
        # the revisit's new page is written through too
        out["settled"].append(sub.settle(backed_up))
        out["records"], out["seqs"] = list(sub.records), list(sub.seqs)
        log = server.log_text()
        out["owners"] = re.findall(
            r"HiCache rank shard: rank (\d)/(\d) owns KV layers", log
        )
        out["cores"] = re.findall(r"Init Unified Radix Cache\..* Tree Core: (\w+)", log)
    except Exception as exc:
        raise RuntimeError(f"{name}: {exc}\n{server.log_tail()}") from exc
    finally:
        t2 = time.monotonic()
        sub.close()
        assert_all_gone(server.stop())
    out["seconds"] = dict(start=t1 - t0, workload=t2 - t1)
    return out


def setUpModule():
    global RUNS
    with concurrent.futures.ThreadPoolExecutor(len(SERVERS)) as pool:
        runs = {name: pool.submit(serve, name) for name in SERVERS}
        RUNS = {name: run.result() for name, run in runs.items()}


class KvEventsTierChecks:
    NAME = ""

    @classmethod
    def setUpClass(cls):
        cls.out = RUNS[cls.NAME]
        cls.page = cls.out["page"]
        cls.history, cls.stores, cls.clears = blocks(cls.out["records"], cls.page)
        print(
            f"{cls.NAME} seconds: {cls.out['seconds']}, settled: {cls.out['settled']}"
        )

    def test_tree_core(self):
        # the tree core every rank built (the Rust one unless told otherwise)
        ranks = 2 if "--tp" in SERVERS[self.NAME]["args"] else 1
        self.assertEqual(self.out["cores"], [SERVERS[self.NAME]["core"]] * ranks)

    def a_blocks(self):
        return chain(self.stores, self.out["a"], self.page)

    def test_revisit_is_a_host_hit(self):
        last = self.out["requests"][-1]
        print(f"{self.NAME} revisit: {last}")
        # A's whole pages come back from the host tier
        self.assertEqual(last["details"].get("host"), len(self.out["a"]), last)

    def test_each_block_of_a_moves_once_per_transition(self):
        a = self.a_blocks()
        self.assertEqual(len(a), len(self.out["a"]) // self.page)
        for i, h in enumerate(a):
            self.assertEqual(self.history[h], EXPECTED_A, (i, h))
        # the host copy is the same chain: same hashes, parents and tokens
        parent = None
        for i, h in enumerate(a):
            key = (parent, tuple(self.out["a"][i * self.page : (i + 1) * self.page]))
            want = [(h, GPU), (h, CPU), (h, GPU)]  # stored, backed up, loaded back
            self.assertEqual(sorted(self.stores[key]), sorted(want))
            parent = h
        # (seq, type, medium, A's blocks in it / its blocks)
        excerpt = [
            (seq, e["type"], e.get("medium"), len(set(e["block_hashes"]) & set(a)))
            + (len(e["block_hashes"]),)
            for seq, _, e in self.out["records"]
            if set(e.get("block_hashes", ())) & set(a)
        ]
        print(f"{self.NAME} events of A's blocks: {excerpt}")

    def test_revisit_tail_chains_to_a(self):
        # the revisit's new page is stored under A's last block, on both tiers
        a = self.a_blocks()
        tail = tuple(self.out["revisit"][len(self.out["a"]) :][: self.page])
        media = sorted(m for _, m in self.stores[(a[-1], tail)])
        self.assertEqual(media, sorted([GPU, CPU]))

    def test_no_transition_reported_twice(self):
        # the tree's reset at startup is seq 0; nothing is cleared after it
        self.assertIn(self.clears, ([], [0]))
        self.assertEqual(alternation_errors(self.history), [])
        # every block the workload stored got its host copy (write-through)
        no_host = [h for h, v in self.history.items() if (STORED, CPU) not in v]
        self.assertEqual(no_host, [])

    def test_one_publisher(self):
        # every batch, in order, from one publisher; the SUB socket may miss
        # seq 0 (the startup reset's AllBlocksCleared, published as the
        # socket binds, before the subscription reaches it), nothing later
        seqs = self.out["seqs"]
        self.assertIn(seqs[0], (0, 1))
        self.assertEqual(seqs, list(range(seqs[0], seqs[0] + len(seqs))))
        self.assertEqual({r[1] for r in self.out["records"]}, {0})


class TestKvEventsPlainHiCache(KvEventsTierChecks, unittest.TestCase):
    NAME = "plain"


class TestKvEventsRankShard(KvEventsTierChecks, unittest.TestCase):
    NAME = "rank-shard"

    def test_rank_shard_active_on_both_ranks(self):
        self.assertEqual(sorted(self.out["owners"]), [("0", "2"), ("1", "2")])


if __name__ == "__main__":
    unittest.main()
