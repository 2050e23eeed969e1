"""The rank-sharded host tier on a running server, for both model families it
covers and both places its shard group lives: a tiny DeepSeek-V3 (plain MLA,
``tiny-mla``, page size 64 as FlashMLA uses) under DP attention (``--tp 4 --dp-size 2
--enable-dp-attention``: two attention-TP groups of 2 ranks, each its own
shard group) and a tiny DeepSeek-V3.2 (MLA + DSA indexer, ``tiny-dsa``, page
size 64) at ``--tp 2``, on CPU (gloo) with HiCache and a 1024-token device
pool per rank, sharded (``SGLANG_ENABLE_HICACHE_RANK_SHARD=1``,
``..._VERIFY_EVERY=1``: every load-back checks that the group's ranks load the
same host pages) against the same server with the switch unset. The two
servers of a model run side by side.

Workloads (greedy, 400-token prompts): ``eviction`` (four prompts, more than
the device pool holds, then the first two again, all four on the DSA pair
(``REVISITS``): their prefixes come back from the host tier), the same shape from 4 concurrent clients (loads and forwards
interleave under the forward gate), ``capacity`` (DSA only: 8 prompts, ~3200
tokens: more than the replicated host tier holds, less than the sharded one,
then the first three again; the capacity code is the same for both pools, and
the 4-rank MLA servers are the dearer pair) and ``negative`` (a prompt pushed
out of the device pool and revisited; on the sharded server rank 0 zeroes one
host page of that load-back first). Under DP attention each request names its
DP rank (``routed_dp_rank``): ``eviction`` goes to DP rank 1 (shard ranks 2
and 3) while DP rank 0 idles, ``negative`` to DP rank 0 (rank 0's group), the
concurrent clients alternate.

Each server records the prefix rows every extend's attention reads, per rank
(``harness.load_record``: KV rows, and for DSA the index-K pages, which dense
attention never reads, so equal outputs cannot prove them), and what each
forward ran: the bytes are compared only after the batches, since on CPU a
request that shares a forward changes another's KV and logits in the last
bits. So every server is flushed once it is up (``/flush_cache?timeout=``,
which answers when every DP rank is idle): a ``/health_generate`` of its
start may still be queued, and would join the first request's forward on
one server and not on the other.

Checks: identical output ids per request; identical ``cached_tokens``,
``cached_tokens_details`` and recorded rows (KV and index K, every rank) on the
sequential workload, with no rows read by an idle DP group's ranks; host hits
present; every rank logs the layers it owns as rank r of its shard group of 2
(under DP attention: the attention-TP group, 2 of the 4 layers each); host
capacity from the geometry (sharded 2x the replicated tier at the same
``--hicache-ratio``); the DSA capacity workload gets more host hits on the
sharded server with the same outputs; the zeroed owner page shows in the record of
layer 0 on both ranks (rank 1 received it in the owner's broadcast) and
nowhere else; both servers stop on SIGTERM leaving no process, except the
replicated MLA server, which ends with TP rank 1's scheduler SIGKILLed under
8 streams: every stream ends in an error within a bound, the whole tree exits
and the port is free (the fault's timings are printed).

Beside the DSA pair a third sharded server runs as two launchers of one TP
rank each (``--nnodes 2``), its shard rank 1 parting from its peer on every
load-back at each point of the group's decision in turn (test-only
variables: not fitting, below the threshold, a full device pool, a failed
allocation after the vote), with the ranks' radix trees compared at every
vote: outputs are the replicated server's, a refused revisit is a miss on
both ranks (it loses exactly its host hits), the full pool a group eviction
and then the load, the first split logged once by each rank naming rank 1,
and each rank logs its layers across the two nodes. The first sharded DSA
server stays up through the restarts below: two sharded instances alive on
one store, the restarted one serves from L3 a prompt the first one put there.

L3: both servers of a pair write every page through to one real Mooncake store
(``harness.mooncake_l3``: a ``mooncake_master`` and a standalone
``mooncake_client`` holding the segment, on 127.0.0.1; ``--hicache-storage-backend
mooncake --hicache-write-policy write_through --enable-metrics``, prefetch
threshold out of reach, so the checks above see the host tier alone). The two
servers share the store: a shard key names its shard, so neither server can
read the other's objects. Checks (the store's own view: the master's keys and
object sizes): every sharded rank's objects hold half of the replicated
server's object of the page (its 2 of 4 layers), both shards of every page are
stored and no shard object has any other name, and each rank's written-bytes
counter (``sglang:hicache_rank_shard_l3_bytes_total``) equals the sizes of its
objects. Then both servers are restarted side by side on the store at ``--tp
2`` (fresh instances: what the first ones put lives in the client's segment;
threshold 256, ``wait_complete``; the MLA pair wrote under DP attention, and a
shard key names the shard group's size, 2 either way) and revisit the eviction
workload's first four prompts from Mooncake. Before the last one the KV object
of one of its pages is removed from the store: on the sharded server rank 1's
shard only, on the replicated one the whole page. Checks: the same bytes in every prefix row
attention reads on both (the load record), the same cached tokens, details and
outputs (a prefix from L3 against a prefix from L3: a fresh prefill may differ
from a cached prefix in a greedy token), the sharded ranks both stop at the
deleted page (cached = the pages before it), and each rank read its share of
each stored page. Outputs are compared up to a bfloat16 tie on both servers
(``harness.greedy_ties``): past a tie the continuations may part, the bytes
may not.

The DSA model's ``index_topk`` (2048) is above every prompt, so DSA selects
every token: a sparse selection would need a torch reference of the DSA
attention backend (``torch_native`` has no ``topk_indices`` path, the DSA
kernels are CUDA), which this suite does not have; the record proves the
index-K tier instead.
"""

import concurrent.futures
import random
import re
import shutil
import tempfile
import time
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci

from harness import load_record, mooncake_l3
from harness.faults import kill_during_streams
from harness.greedy_ties import TOP2, assert_same_greedy, top2_of, without_top2
from harness.live_server import (
    HICACHE_ARGS,
    LiveServer,
    assert_all_gone,
    greedy,
    port_release,
)

register_cpu_ci(est_time=540, suite="base-b-test-cpu")
FEATURE_GROUP = "hicache-rank-shard"  # the series group it tests (or "series")
PROJECT_ONLY = "runs this project's CPU server (stand-ins, local tiny model)"

DEVICE_TOKENS, RATIO, LAYERS = 1024, 2, 4  # both tiny models: 4 layers
RECORDS = ("rank", "batches-rank")  # harness.load_record: rows, forwards
PAGE = {"tiny-mla": 64, "tiny-dsa": 64}  # DSA forces 64; FlashMLA's page for MLA
SHARD = 2  # ranks of a shard group: the TP group, or an attention-TP group
LAUNCH = {
    "tiny-mla": [
        "--tp",
        "4",
        "--dp-size",
        "2",
        "--enable-dp-attention",
        "--page-size",
        "64",
    ],
    "tiny-dsa": ["--tp", "2"],
}
RANKS = {"tiny-mla": 4, "tiny-dsa": 2}  # TP ranks (scheduler processes)
# The L3 restarts run at --tp 2 without DP attention: a shard object's key
# names its shard group's size (2 either way), not the launch, so the TP=2
# server reads what the DP-attention server's groups wrote (and it starts
# half the processes).
RESTART_LAUNCH = ["--tp", "2", "--page-size", "64"]
ARGS = ["--max-total-tokens", str(DEVICE_TOKENS)]
ARGS += HICACHE_ARGS + ["--hicache-ratio", str(RATIO)]
# The DP rank of each sequential workload under DP attention (routed_dp_rank);
# the concurrent clients alternate.
ROUTE = {"eviction": 1, "negative": 0}
CAPACITY_WORKLOAD = {"tiny-dsa"}
SHARDED = {
    "SGLANG_ENABLE_HICACHE_RANK_SHARD": "1",
    "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "1",
}
REPLICATED = {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "0"}
# Test-only: shard rank 1 parts from its peer on every load-back, at each
# point of the group's decision in turn (hicache_rank_shard/agreement.py):
# it reads the load-back as not fitting, as below the threshold, its device
# pool as full (it must evict the whole load-back) and fails the allocation
# after the group voted for it. The eviction workload's four revisits are
# one load-back each, so each point once. That server is launched as two
# nodes of one TP rank each (--nnodes 2): its loads cross the nodes in the
# owners' broadcasts, verified (VERIFY_EVERY=1: each vote also compares the
# ranks' radix trees).
INJECTED = ("fit", "threshold", "evict", "alloc")
MISSED = {"fit", "threshold", "alloc"}  # "evict": the group evicts, then loads
REFUSING = dict(
    SHARDED,
    SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_RANK="1",
    SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_EVERY="1",
    SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_POINT=",".join(INJECTED),
)
# The eviction workload revisits this many of its four prompts: four where
# the refusing server parts at each of the four INJECTED points, two on the
# other pair
REVISITS = {"tiny-mla": 2, "tiny-dsa": len(INJECTED)}
REFUSING_MODEL = "tiny-dsa"  # a third server beside that model's pair
# Two rank-sharded instances (same model, same TP) alive on one store: the
# first sharded server stays up through the restarts; the restarted one then
# serves a prompt the first one put in the store meanwhile (``shared``).
SHARED_INSTANCES = {"tiny-dsa"}
TRIGGER = {"tiny-mla": "corrupt-kv", "tiny-dsa": "corrupt-index-k"}
FIELD = {"tiny-mla": "kv", "tiny-dsa": "index_k"}
WORDS = (
    "cache prefix token rank host device page layer tree radix decode prefill "
    "router batch request server model kernel stream copy shard budget queue"
).split()
PROMPT_WORDS = 400  # one token per word with the tiny tokenizer
NEW_TOKENS = 4
FAULT_SERVER = ("tiny-mla", "replicated")  # hosts the TP rank kill at its end
FAULT_BOUND_S = 60.0  # kill to every client answered and the tree gone
FAULT_TOKENS = 96  # 8 streams of ~100 tokens fit the 1024-token device pool
# L3: both servers of a pair write every page through to one Mooncake store;
# in that run nothing is prefetched (the threshold is out of reach), so the
# checks above see the host tier alone. Both are then restarted on the store
# (the default 256-token threshold) and revisit the eviction workload's four
# prompts.
L3_ARGS = ["--hicache-write-policy", "write_through"]
L3_ARGS += ["--hicache-storage-prefetch-policy", "wait_complete", "--enable-metrics"]
WRITE_ONLY = dict(prefetch_threshold=1 << 30)
STORE_SEGMENT = "256 MB"  # a pair's pages are a few MB
# rank 1's KV shard of the page that ends here is deleted before the restart's
# last revisit: both ranks prefetch the pages before it (at least the 256-token
# prefetch threshold), none after
DELETED_AT = {"tiny-mla": 320, "tiny-dsa": 320}


def line_counts(records):
    """Each rank's count of record lines so far (a slice's start)."""
    return [len(r) for r in records]


def prompts(seed, n, revisit):
    rng = random.Random(seed)
    first = [" ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS)) for _ in range(n)]
    return first + [p + " shard" for p in first[:revisit]]


def one(server, text, dp_rank=None):
    payload = {"text": text, "sampling_params": greedy(NEW_TOKENS), **TOP2}
    if dp_rank is not None:
        payload["routed_dp_rank"] = dp_rank
    r = server.generate(payload)
    meta = r["meta_info"]
    return dict(
        output_ids=r["output_ids"],
        top2=top2_of(meta),
        cached=meta["cached_tokens"],
        details=meta.get("cached_tokens_details") or {},
        prompt=meta["prompt_tokens"],
    )


def owners(log):
    return re.findall(
        r"HiCache rank shard: rank (\d)/(\d) owns KV layers (\[[\d, ]*\])"
        r"(?: and indexer layers (\[[\d, ]*\]))?",
        log,
    )


def refusals(log):
    """The group's log of its split load-backs: the first one only."""
    return re.findall(
        r"HiCache rank shard: a load-back of (\d+) tokens: shard rank\(s\) "
        r"(.*?) of 2 (refused it|could not allocate)",
        log,
    )


def dp_rank(model, kind, i=0):
    if "--enable-dp-attention" not in LAUNCH[model]:
        return None
    return ROUTE[kind] if kind in ROUTE else i % 2


def workload(server, model, record_dir, corrupt):
    ranks = RANKS[model]

    def mark():
        return [line_counts(load_record.read(record_dir, ranks, p)) for p in RECORDS]

    def run(kind, texts):
        return [one(server, t, dp_rank(model, kind)) for t in texts]

    # the start's /health_generate polls are forwards too: the record is
    # compared from here on (serve flushed the server: they are done)
    start = mark() if record_dir else None
    out = dict(eviction=run("eviction", prompts(23, 4, REVISITS[model])))
    if not corrupt and not record_dir:  # the refusing server: that workload only
        log = server.log_text()
        out["refusals"] = refusals(log)
        out["owners"] = owners(log)
        out["errors"] = log.count("HiCache rank shard verify")
        return out
    marks = [mark()]
    texts = list(enumerate(prompts(41, 4, 2)))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out["concurrent"] = list(
            pool.map(lambda it: one(server, it[1], dp_rank(model, "", it[0])), texts)
        )
    if model in CAPACITY_WORKLOAD:
        out["capacity"] = run("capacity", prompts(57, 8, 3))
    # a prompt, then two more (1200 tokens: it leaves the device pool), then
    # it again: its prefix is loaded back from the host tier
    texts = prompts(71, 3, 1)
    out["negative"] = run("negative", texts[:-1])
    marks.append(mark())
    if corrupt:
        (Path(record_dir) / TRIGGER[model]).touch()
    out["negative"] += run("negative", texts[-1:])
    out["trigger_left"] = (Path(record_dir) / TRIGGER[model]).exists()
    records = load_record.read(record_dir, ranks)
    out["record_eviction"] = [
        r[start[0][i] : marks[0][0][i]] for i, r in enumerate(records)
    ]
    out["record_negative"] = [r[marks[1][0][i] :] for i, r in enumerate(records)]
    batches = load_record.read(record_dir, ranks, "batches-rank")
    out["batches_eviction"] = [
        b[start[1][i] : marks[0][1][i]] for i, b in enumerate(batches)
    ]
    log = server.log_text()
    out["host_pool_tokens"] = [
        int(n)
        for n in re.findall(
            r"Allocating kv hierarchical KV host pool: (\d+) tokens", log
        )
    ]
    out["owners"] = owners(log)
    out["errors"] = log.count("HiCache rank shard verify")
    return out


def serve(model, name, env, store=None, keep=False):
    """Starts one server of the pair and runs its workload; ``keep``: it is
    left running, its ``LiveServer`` and load record in ``out["kept"]``, for
    the caller to stop."""
    record_dir = ""
    if name != "refusing":
        record_dir = tempfile.mkdtemp(prefix=f"load-record-{model}-{name}-")
        env = dict(env, **{load_record.ENV: record_dir})
    args = LAUNCH[model] + ARGS
    if store is not None:
        args += L3_ARGS + store.server_args(**WRITE_ONLY)
    t0 = time.monotonic()
    nodes = 2 if name == "refusing" else 1  # one launcher per TP rank
    server = LiveServer(
        "patched",
        args,
        env=env,
        name=f"{model}-{name}",
        model=model,
        nodes=nodes,
    )
    t1 = time.monotonic()
    kept = False
    try:
        server.flush_cache()  # the start's health checks done (batches alike)
        out = workload(server, model, record_dir, corrupt=name == "sharded")
        if name == "sharded":
            out["l3"] = mooncake_l3.settled(server, store)
        if (model, name) == FAULT_SERVER:
            # End of life: TP rank 1's scheduler killed under 8 streams.
            roles = server.roles()
            (victim,) = [
                pid
                for role, pid in roles.items()
                if re.fullmatch(r"sglang::scheduler_(DP\d+_)?TP1", role)
            ]
            out["fault"] = kill_during_streams(
                server.base_url, server.pids(), victim, FAULT_TOKENS
            )
            out["fault"]["port"] = port_release(server.port)
        if keep:
            out["kept"] = dict(server=server, record_dir=record_dir)
            kept = True
    except Exception as exc:
        raise RuntimeError(f"{model} {name}: {exc}\n{server.log_tail()}") from exc
    finally:
        t2 = time.monotonic()
        if not kept:
            assert_all_gone(server.stop())
    out["seconds"] = dict(start=t1 - t0, workload=t2 - t1, stop=time.monotonic() - t2)
    return out


def shared(model, reader, reader_dir, writer, store) -> dict:
    """Two sharded instances alive on one store: ``writer`` (the first
    sharded server, still up) serves a new prompt, which its write-through
    puts in the store; once those puts have landed (each rank's shard of
    every full page is there, and each rank's written bytes equal its
    objects' growth), ``reader`` (the restarted one) serves
    the same prompt from L3,
    and ``writer`` again, from its own device cache. Returns both revisits,
    the shard objects found, and each one's record of the prefix rows."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    text = prompts(89, 1, 0)[0]
    # what the writer has put so far against what its ranks' shards hold
    # (the restart rewrote a deleted shard meanwhile)
    now = mooncake_l3.settled(writer["server"], store, timeout=0)
    base = {
        r: sum(now["objects"].get(r, {}).values())
        - now["counters"].get((r, "written"), 0)
        for r in (0, 1)
    }
    ids = reader.post_raw("/tokenize", {"prompt": text}).json()["tokens"]
    hashes = get_storage_hash_str(ids, None, page_size=PAGE[model])
    kinds = ("k", "indexer") if model == "tiny-dsa" else ("k",)
    pages = len(ids) // PAGE[model]
    out = dict(first=one(writer["server"], text))
    # its backups landed: each rank's shard of every full page and kind is
    # there, and each rank's written bytes equal its objects' growth
    mooncake_l3.settled(
        writer["server"], store, base=base, pages=hashes[:pages], kinds=kinds
    )
    keys = store.keys()
    found = [
        k
        for h in hashes[:pages]
        for kind in kinds
        for k in mooncake_l3.page_objects(keys, h, kind)
    ]
    out.update(pages=pages, objects=sorted(found))
    dirs = dict(writer=writer["record_dir"], reader=reader_dir)
    before = {who: line_counts(load_record.read(d, SHARD)) for who, d in dirs.items()}
    out["reader"] = one(reader, text)
    out["writer"] = one(writer["server"], text)
    for who, d in dirs.items():
        records = load_record.read(d, SHARD)
        out[f"record_{who}"] = [r[m:] for r, m in zip(records, before[who])]
    return out


def restart(model, name, store, writer=None):
    """A fresh server of the pair on the same store: it revisits the eviction
    workload's first four prompts from L3. Before the last one, the KV object
    of its page ending at DELETED_AT is removed from the store: on the sharded
    server rank 1's shard only, on the replicated one the whole page. With
    ``writer`` (the first sharded server, kept running): then ``shared``."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    texts = prompts(23, 4, 2)[:4]
    sharded = name == "sharded"
    record_dir = tempfile.mkdtemp(prefix=f"load-record-{model}-{name}-restart-")
    env = dict(SHARDED if sharded else REPLICATED)
    env[load_record.ENV] = record_dir
    settled = mooncake_l3.settled if sharded else lambda *a, **k: {}
    t0 = time.monotonic()
    server = LiveServer(
        "patched",
        RESTART_LAUNCH + ARGS + L3_ARGS + store.server_args(),
        env=env,
        name=f"{model}-{name}-restart",
        model=model,
    )
    t1 = time.monotonic()
    try:
        server.flush_cache()  # the start's health checks done (batches alike)
        start = {
            p: line_counts(load_record.read(record_dir, SHARD, p)) for p in RECORDS
        }
        out = dict(before=settled(server, store, timeout=0))
        out["revisits"] = [one(server, t) for t in texts[:-1]]
        ids = server.post_raw("/tokenize", {"prompt": texts[-1]}).json()["tokens"]
        page = PAGE[model]
        hashes = get_storage_hash_str(ids, None, page_size=page)
        doomed = DELETED_AT[model] // page  # the page after the last kept one
        kv = mooncake_l3.page_objects(store.keys(), hashes[doomed], kind="k")
        out["deleted"] = [
            k for k in kv if mooncake_l3.shard_of(k) == (1 if sharded else None)
        ]
        out["removed"] = store.remove(out["deleted"])
        out["start"] = settled(server, store, timeout=0)
        out["revisits"].append(one(server, texts[-1]))
        if sharded:
            base = {r: sum(f.values()) for r, f in out["start"]["objects"].items()}
            out["end"] = mooncake_l3.settled(server, store, base=base)
        out["errors"] = server.log_text().count("HiCache rank shard verify")
        ends = {
            p: [r[m:] for r, m in zip(load_record.read(record_dir, SHARD, p), start[p])]
            for p in RECORDS
        }
        if writer is not None:
            out["shared"] = shared(model, server, record_dir, writer, store)
    except Exception as exc:
        raise RuntimeError(
            f"{model} {name} restart: {exc}\n{server.log_tail()}"
        ) from exc
    finally:
        t2 = time.monotonic()
        assert_all_gone(server.stop())
    out["record"], out["batches"] = ends["rank"], ends["batches-rank"]
    shutil.rmtree(record_dir, ignore_errors=True)
    out["seconds"] = dict(start=t1 - t0, workload=t2 - t1, stop=time.monotonic() - t2)
    return out


def run_pair(model, store):
    servers = dict(sharded=SHARDED, replicated=REPLICATED)
    if model == REFUSING_MODEL:
        servers["refusing"] = REFUSING
    l3 = ("sharded", "replicated")  # the refusing server has no L3
    keep = model in SHARED_INSTANCES  # the first sharded server stays up
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        runs = {
            k: pool.submit(
                serve,
                model,
                k,
                env,
                store if k in l3 else None,
                keep=keep and k == "sharded",
            )
            for k, env in servers.items()
        }
        concurrent.futures.wait(runs.values())
        writer = None
        try:
            out = {k: run.result() for k, run in runs.items()}
            writer = out["sharded"].pop("kept", None)
            out["store_after_first"] = mooncake_l3.objects(store)
            # both restarted side by side: a prefix from L3 is compared with
            # a prefix from L3 (a cached prefix and a fresh prefill may differ
            # in the last bits, and so in a greedy token, on either server)
            restarts = {
                k: pool.submit(
                    restart, model, k, store, writer if k == "sharded" else None
                )
                for k in l3
            }
            out.update({f"restart_{k}": run.result() for k, run in restarts.items()})
        finally:
            if writer is None and runs["sharded"].exception() is None:
                writer = runs["sharded"].result().pop("kept", None)
            if writer is not None:
                assert_all_gone(writer["server"].stop())
    return out


class RankShardServerChecks:
    MODEL = ""
    runs: dict = {}

    def assertSameGreedy(self, ours, theirs, what):
        # greedy tokens equal up to a bfloat16 tie (harness.greedy_ties): the
        # KV itself is compared byte for byte in the load records
        ties = assert_same_greedy(self, ours, theirs, what)
        if ties:
            print(f"{self.MODEL} {what}: outputs part at a tie (request, token) {ties}")

    def assertSameBatches(self, ours, theirs):
        # every forward, per rank: the same requests' prefix and extend
        # lengths and, under DP attention, every DP rank's tokens
        self.assertTrue(any(ours), "no rank recorded a forward")
        self.assertEqual(len(ours), len(theirs))
        for rank, (a, b) in enumerate(zip(ours, theirs)):
            self.assertEqual(a, b, f"rank {rank}: the servers ran other batches")

    def assertSameServed(self, ours, theirs, what):
        self.assertEqual(
            [without_top2(r) for r in ours], [without_top2(r) for r in theirs], what
        )
        self.assertSameGreedy(ours, theirs, what)

    @classmethod
    def setUpClass(cls):
        cls.store = mooncake_l3.MooncakeStore(segment=STORE_SEGMENT)
        cls.addClassCleanup(cls.stop_store)
        cls.runs = run_pair(cls.MODEL, cls.store)
        seconds = [cls.runs[name]["seconds"] for name in ("sharded", "replicated")]
        print(f"{cls.MODEL} seconds (sharded / replicated): {seconds}")

    @classmethod
    def stop_store(cls):
        held = cls.store.stop()["held_ports"]
        assert not held, f"the Mooncake store's ports still held: {held}"

    def aligned(self, tokens):
        return tokens // PAGE[self.MODEL] * PAGE[self.MODEL]

    def serving(self, kind):
        """The TP ranks that served a sequential workload: its DP rank's
        attention-TP group under DP attention, else every rank."""
        dp = dp_rank(self.MODEL, kind)
        ranks = range(RANKS[self.MODEL])
        return list(ranks if dp is None else ranks[dp * SHARD : (dp + 1) * SHARD])

    def test_every_rank_owns_its_layers(self):
        # Every TP rank logs its rank r of its shard group of SHARD (under DP
        # attention its attention-TP group): LAYERS / SHARD layers each.
        owners = sorted(self.runs["sharded"]["owners"])
        indexer = {"tiny-mla": "", "tiny-dsa": "[0, 2]"}[self.MODEL]
        other = {"tiny-mla": "", "tiny-dsa": "[1, 3]"}[self.MODEL]
        groups = RANKS[self.MODEL] // SHARD
        expected = [("0", "2", "[0, 2]", indexer)] * groups
        expected += [("1", "2", "[1, 3]", other)] * groups
        self.assertEqual(owners, expected)
        self.assertEqual(self.runs["replicated"]["owners"], [])
        self.assertEqual(self.runs["sharded"]["errors"], 0)

    def test_host_capacity_from_the_geometry(self):
        # ratio x device tokens, plus one padding page; sharded: the same host
        # bytes hold LAYERS / ceil(LAYERS / SHARD) times the tokens.
        page, ranks = PAGE[self.MODEL], RANKS[self.MODEL]
        replicated = DEVICE_TOKENS * RATIO + page
        sharded = DEVICE_TOKENS * RATIO * LAYERS // -(-LAYERS // SHARD) + page
        self.assertEqual(
            self.runs["replicated"]["host_pool_tokens"], [replicated] * ranks
        )
        self.assertEqual(self.runs["sharded"]["host_pool_tokens"], [sharded] * ranks)

    def test_same_outputs_cache_hits_and_rows_as_replicated(self):
        ours, theirs = self.runs["sharded"], self.runs["replicated"]
        self.assertSameServed(ours["eviction"], theirs["eviction"], "eviction")
        for r in ours["eviction"][-REVISITS[self.MODEL] :]:  # whole prefix: host
            self.assertGreaterEqual(
                r["details"].get("host", 0), self.aligned(PROMPT_WORDS) - 8, r
            )
        for kind in ("concurrent", "capacity")[: 1 + (self.MODEL in CAPACITY_WORKLOAD)]:
            self.assertSameGreedy(ours[kind], theirs[kind], kind)
        # the rows attention read for every cached prefix, on every rank;
        # none on an idle DP group's ranks. Bytes are compared between
        # forwards of the same batches (harness.load_record): first those.
        self.assertSameBatches(ours["batches_eviction"], theirs["batches_eviction"])
        self.assertEqual(ours["record_eviction"], theirs["record_eviction"])
        serving = self.serving("eviction")
        for i, rank in enumerate(ours["record_eviction"]):
            if i not in serving:
                self.assertEqual(rank, [], i)
                continue
            loaded = [e for e in rank if e["prefix"] >= self.aligned(PROMPT_WORDS)]
            self.assertEqual(len(loaded), REVISITS[self.MODEL] * LAYERS, rank)
            if self.MODEL == "tiny-dsa":
                self.assertTrue(all("index_k" in e for e in rank))

    def test_zeroed_owner_page_shows_in_the_record(self):
        # Negative control of the record check: rank 0 zeroed one host page
        # of layer 0 (its own) before the load-back; both ranks of its group
        # read it, rank 1 through the owner's broadcast, and nothing else
        # differs (under DP attention the other group served nothing then).
        ours, theirs = self.runs["sharded"], self.runs["replicated"]
        self.assertFalse(ours["trigger_left"], "the corrupted load-back never ran")
        host = ours["negative"][-1]["details"].get("host", 0)
        self.assertGreaterEqual(host, self.aligned(PROMPT_WORDS) - 8)
        differing = set()
        for rank, (a, b) in enumerate(
            zip(ours["record_negative"], theirs["record_negative"])
        ):
            self.assertEqual(len(a), len(b))
            # one revisit, every layer, on the serving ranks
            self.assertEqual(len(a), LAYERS if rank in self.serving("negative") else 0)
            for x, y in zip(a, b):
                for field in x:
                    if x[field] != y[field]:
                        differing.add((rank, x["layer"], field))
        self.assertEqual(
            differing, {(0, 0, FIELD[self.MODEL]), (1, 0, FIELD[self.MODEL])}
        )

    # ------------------------------------------------------------------ L3
    def shard_bytes(self) -> dict:
        """One page of a rank's shard object, per kind (KV ``k``, DSA
        ``indexer``), from the geometry: upstream's object of the page (the
        replicated server's, every layer) holds LAYERS layers, each rank owns
        LAYERS / SHARD of them (test_every_rank_owns_its_layers); no draft
        layers are packed."""
        full = {}
        for key, size in self.runs["store_after_first"]["replicated"].items():
            full.setdefault(mooncake_l3.kind_of(key), set()).add(size)
        kinds = {"k", "indexer"} if self.MODEL == "tiny-dsa" else {"k"}
        self.assertEqual(set(full), kinds)
        self.assertTrue(all(len(sizes) == 1 for sizes in full.values()), full)
        return {
            kind: sizes.pop() * (LAYERS // SHARD) // LAYERS
            for kind, sizes in full.items()
        }

    def test_l3_every_rank_stores_its_own_share_once(self):
        share = self.shard_bytes()
        l3 = self.runs["sharded"]["l3"]
        pages = []
        for rank in (0, 1):
            objects = l3["objects"][rank]
            self.assertTrue(objects, rank)
            for key, size in objects.items():
                self.assertEqual(size, share[mooncake_l3.kind_of(key)], key)
            pages.append({mooncake_l3.page_of(k) for k in objects})
            # the counter: this rank's objects, each written once
            written = l3["counters"].get((rank, "written"))
            self.assertEqual(written, sum(objects.values()), rank)
            self.assertEqual(l3["counters"].get((rank, "read")), 0)  # no prefetch yet
        # every page has both ranks' shards, each stored once, and every key
        # in the store is a shard object, an unsharded one or a warmup
        self.assertEqual(pages[0], pages[1])
        self.assertEqual(self.runs["store_after_first"]["other"], [])

    def test_l3_restart_serves_revisits_from_storage(self):
        share = self.shard_bytes()
        rs, theirs = self.runs["restart_sharded"], self.runs["restart_replicated"]
        print(f"{self.MODEL} restart seconds: {rs['seconds']}")
        print(
            f"{self.MODEL} restart revisits: {[r['details'] for r in rs['revisits']]}"
        )
        print(f"{self.MODEL} restart L3 counters: {rs['end']['counters']}")
        # the same outputs and cached tokens as the replicated server,
        # restarted on its own L3 (its whole page deleted where ours lost one
        # shard): the same bytes in every prefix row attention read first,
        # written by the first pair in the same batches (checked above)
        self.assertSameBatches(rs["batches"], theirs["batches"])
        self.assertEqual(rs["record"], theirs["record"])
        self.assertSameServed(rs["revisits"], theirs["revisits"], "restart")
        self.assertEqual(
            [len(r) for r in rs["record"]], [LAYERS * len(rs["revisits"])] * SHARD
        )
        for r in rs["revisits"][:-1]:
            self.assertGreater(r["details"].get("storage", 0), 0, r)
            self.assertGreaterEqual(r["cached"], self.aligned(PROMPT_WORDS) - 8, r)
        # rank 1's shard of one page removed: a miss from that page on, on
        # both ranks (each read only the pages before it, below)
        self.assertEqual(len(rs["deleted"]), 1, rs["deleted"])
        self.assertEqual(len(theirs["deleted"]), 1, theirs["deleted"])
        self.assertEqual(rs["removed"] + theirs["removed"], [0, 0])
        last = rs["revisits"][-1]
        self.assertGreater(last["details"].get("storage", 0), 0, last)
        self.assertEqual(last["cached"], DELETED_AT[self.MODEL], last)
        # every rank read its own share of each page served from storage
        stored_pages = sum(r["details"].get("storage", 0) for r in rs["revisits"])
        stored_pages //= PAGE[self.MODEL]
        for rank in (0, 1):
            self.assertEqual(
                rs["end"]["counters"].get((rank, "read")),
                stored_pages * sum(share.values()),
                rank,
            )
            # and wrote only what it found missing: rank 1 its deleted shard
            before = rs["before"]["objects"][rank]
            gone = sum(before[n] for n in rs["deleted"] if n in before)
            grown = sum(rs["end"]["objects"][rank].values()) - sum(before.values())
            written = rs["end"]["counters"].get((rank, "written"))
            self.assertEqual(written, grown + gone, rank)
        self.assertEqual(rs["errors"], 0)


class TestRankShardServerMLA(RankShardServerChecks, unittest.TestCase):
    MODEL = "tiny-mla"

    def test_a_killed_tp_rank_ends_every_stream_and_the_server(self):
        # SIGKILL of scheduler TP1 (DP rank 0's second attention-TP rank)
        # under 8 streams: the survivors' collective fails, the launcher stops
        # the tree; every stream ends in an error (none can finish: the MLP is
        # split over all four ranks), nothing hangs.
        fault = self.runs["replicated"]["fault"]
        print(f"TP rank kill: {fault}")
        self.assertEqual([s["state"] for s in fault["streams"]], ["error"] * 8, fault)
        self.assertIsNotNone(fault["clients_s"], fault)
        self.assertLess(fault["clients_s"], FAULT_BOUND_S, fault)
        self.assertEqual(fault["left"], [], fault)
        self.assertIsNotNone(fault["tree_s"], fault)
        self.assertTrue(fault["port"]["free"], fault)


class TestRankShardServerDSA(RankShardServerChecks, unittest.TestCase):
    MODEL = "tiny-dsa"

    def test_capacity_gain_shown_live(self):
        def host(run):
            return sum(r["details"].get("host", 0) for r in run["capacity"][-3:])

        def computed(run):
            return sum(r["prompt"] - r["cached"] for r in run["capacity"][-3:])

        ours, theirs = self.runs["sharded"], self.runs["replicated"]
        print(
            f"{self.MODEL} capacity workload revisits: host tokens sharded "
            f"{host(ours)}, replicated {host(theirs)}; prefilled "
            f"{computed(ours)} vs {computed(theirs)}"
        )
        # 3200 revisitable tokens: the sharded 4096-token tier holds the first
        # three prompts (a few leading tokens may still be on the device), so
        # it prefills only each revisit's unaligned tail; the replicated
        # 2048-token tier holds at most five of the eight, and has lost at
        # least one of the first three.
        full = self.aligned(PROMPT_WORDS)
        self.assertGreaterEqual(host(ours), 3 * full - 3 * 8)
        self.assertLessEqual(computed(ours), 3 * (PROMPT_WORDS + 1 - full))
        self.assertLessEqual(host(theirs), host(ours) - full)
        self.assertGreaterEqual(computed(theirs), computed(ours) + full)

    def test_two_sharded_instances_share_one_store(self):
        # The first sharded server, still up, served a new prompt: its write-
        # through put both ranks' shard objects of every page, per kind. The
        # restarted server, alive beside it on the store, served the same
        # prompt from L3: its whole aligned prefix, the rows attention read
        # equal to those the first one reads from its own device cache, on
        # each rank and layer, and so the same outputs.
        sh = self.runs["restart_sharded"]["shared"]
        full = self.aligned(PROMPT_WORDS)
        print(f"{self.MODEL} shared instances: {sh['reader']['details']}")
        self.assertEqual(sh["pages"], full // PAGE[self.MODEL])
        self.assertEqual(len(sh["objects"]), sh["pages"] * 2 * SHARD, sh["objects"])
        reader, writer = sh["reader"], sh["writer"]
        self.assertEqual(reader["details"].get("storage"), full, reader)
        self.assertEqual(reader["cached"], full, reader)
        self.assertEqual(writer["details"].get("device"), full, writer)
        self.assertEqual([len(r) for r in sh["record_reader"]], [LAYERS] * SHARD)
        self.assertEqual(sh["record_reader"], sh["record_writer"])
        self.assertEqual(
            (reader["output_ids"], reader["top2"]),
            (writer["output_ids"], writer["top2"]),
        )

    def test_two_nodes_shard_and_a_rank_parting_anywhere_is_agreed(self):
        # Shard rank 1 parts from its peer on each of the four revisits'
        # load-backs, at the next point of the decision (INJECTED): not
        # fitting, below the threshold and a failed allocation after the vote
        # are a miss on both ranks (recomputed: no hang, no mismatch; the
        # revisit loses exactly the host hits it had on the replicated
        # server); a full device pool on one rank is a group eviction, then
        # the load. Every vote compared the two ranks' radix trees
        # (VERIFY_EVERY=1), so they stayed alike throughout.
        ours, theirs = self.runs["refusing"], self.runs["replicated"]
        # sharded across the two nodes: each TP rank logs its own layers
        self.assertEqual(sorted(ours["owners"]), sorted(self.runs["sharded"]["owners"]))
        self.assertSameGreedy(ours["eviction"], theirs["eviction"], "refusing")
        loads = [
            i for i, r in enumerate(theirs["eviction"]) if r["details"].get("host")
        ]
        self.assertEqual(loads, list(range(4, 4 + len(INJECTED))), theirs["eviction"])
        missed = [i for i, point in zip(loads, INJECTED) if point in MISSED]
        for i, (a, b) in enumerate(zip(ours["eviction"], theirs["eviction"])):
            if i in missed:
                self.assertEqual(a["cached"], b["cached"] - b["details"]["host"], i)
                self.assertEqual(a["details"].get("host", 0), 0, i)
            else:  # the replicated server has L3 too: its details say so
                b = dict(b, details=dict(b["details"]))
                for key in ("storage", "storage_backend"):
                    b["details"].pop(key, None)
                self.assertEqual(a, b, i)
        # the first split logged once by each rank, naming the refusing rank,
        # its verdict and the load's size (the next ones are counted)
        size = str(theirs["eviction"][loads[0]]["details"]["host"])
        first = (size, "{1: 'no fit'}", "refused it")
        self.assertEqual(ours["refusals"], [first] * SHARD)
        self.assertEqual(ours["errors"], 0)


if __name__ == "__main__":
    unittest.main()
