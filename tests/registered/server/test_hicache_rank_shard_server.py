"""The rank-sharded host tier on a running server, for both model families it
covers: a tiny DeepSeek-V3 (plain MLA, ``tiny-mla``, page size 1) and a tiny
DeepSeek-V3.2 (MLA + DSA indexer, ``tiny-dsa``, page size 64), each at
``--tp 2`` on CPU (gloo) with HiCache and a 1024-token device pool, sharded
(``SGLANG_ENABLE_HICACHE_RANK_SHARD=1``, ``..._VERIFY_EVERY=1``: every load-back
checks that both ranks load the same host pages) against the same server with
the switch unset. The two servers of a model run side by side.

Workloads (greedy, 400-token prompts): ``eviction`` (four prompts, more than
the device pool holds, then the first two again: their prefixes come back from
the host tier), the same shape from 4 concurrent clients (loads and forwards
interleave under the forward gate), ``capacity`` (8 prompts, ~3200 tokens:
more than the replicated host tier holds, less than the sharded one, then the
first three again) and ``negative`` (a prompt pushed out of the device pool and
revisited; on the sharded server rank 0 zeroes one host page of that
load-back first).

Each server records the prefix rows every extend's attention reads, per rank
(``harness.load_record``: KV rows, and for DSA the index-K pages, which dense
attention never reads, so equal outputs cannot prove them).

Checks: identical output ids per request; identical ``cached_tokens``,
``cached_tokens_details`` and recorded rows (KV and index K, both ranks) on the
sequential workload; host hits present; every rank logs the layers it owns;
host capacity from the geometry (sharded 2x the replicated tier at the same
``--hicache-ratio``); the capacity workload gets more host hits on the sharded
server with the same outputs; the zeroed owner page shows in the record of
layer 0 on both ranks (rank 1 received it in the owner's broadcast) and
nowhere else; both servers stop on SIGTERM leaving no process, except the
replicated MLA server, which ends with one TP rank's scheduler SIGKILLed under
8 streams: every stream ends in an error within a bound, the whole tree exits
and the port is free (the fault's timings are printed).

L3: both servers of a pair write every page through to a ``file`` directory of
their own (``--hicache-storage-backend file --hicache-write-policy write_through
--enable-metrics``, prefetch threshold out of reach, so the checks above see the
host tier alone). Checks: every sharded rank's objects hold half of the
replicated server's object of the page (its 2 of 4 layers), both shards of every
page and nothing else are on disk, and each rank's written-bytes counter
(``sglang:hicache_rank_shard_l3_bytes_total``) equals its objects. Then the
sharded server is restarted alone on its directory (threshold 256,
``wait_complete``) and revisits the eviction workload's first four prompts:
served from storage with the replicated server's outputs, each rank reading its
share of each stored page; rank 1's shard of one page of the last prompt is
deleted first, so both ranks stop there (cached = the pages before it).

The DSA model's ``index_topk`` (2048) is above every prompt, so DSA selects
every token: a sparse selection would need a torch reference of the DSA
attention backend (``torch_native`` has no ``topk_indices`` path, the DSA
kernels are CUDA), which this suite does not have; the record proves the
index-K tier instead.
"""

import concurrent.futures
import json
import os
import random
import re
import shutil
import tempfile
import time
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci

from harness import load_record
from harness.faults import kill_during_streams
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

TP, DEVICE_TOKENS, RATIO, LAYERS = 2, 1024, 2, 4  # both tiny models: 4 layers
PAGE = {"tiny-mla": 1, "tiny-dsa": 64}  # DSA forces page size 64
ARGS = ["--tp", str(TP), "--max-total-tokens", str(DEVICE_TOKENS)]
ARGS += HICACHE_ARGS + ["--hicache-ratio", str(RATIO)]
SHARDED = {
    "SGLANG_ENABLE_HICACHE_RANK_SHARD": "1",
    "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "1",
}
REPLICATED = {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "0"}
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
# L3: both servers of a pair write every page through to a `file` directory of
# their own; in that run nothing is prefetched (the threshold is out of reach),
# so the checks above see the host tier alone. The sharded server is then
# restarted alone on its directory (the default 256-token threshold) and
# revisits the eviction workload's four prompts.
L3_ARGS = ["--hicache-storage-backend", "file", "--hicache-write-policy"]
L3_ARGS += ["write_through", "--hicache-storage-prefetch-policy", "wait_complete"]
L3_ARGS += ["--enable-metrics"]
WRITE_ONLY = ["--hicache-storage-backend-extra-config"]
WRITE_ONLY += [json.dumps({"prefetch_threshold": 1 << 30})]
STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
L3_METRIC = "sglang:hicache_rank_shard_l3_bytes_total"
SHARD_FILE = re.compile(r"^([0-9a-f]{64})(\.indexer)?_.*_rankshard-rr-tp2-r(\d)\.bin$")
REPLICATED_FILE = re.compile(r"^([0-9a-f]{64})(\.indexer)?_[^_]*\.bin$")
# rank 1's KV shard of the page that ends here is deleted before the restart's
# last revisit: both ranks prefetch the pages before it (at least the 256-token
# prefetch threshold), none after
DELETED_AT = {"tiny-mla": 300, "tiny-dsa": 320}


def prompts(seed, n, revisit):
    rng = random.Random(seed)
    first = [" ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS)) for _ in range(n)]
    return first + [p + " shard" for p in first[:revisit]]


def one(server, text):
    r = server.generate({"text": text, "sampling_params": greedy(NEW_TOKENS)})
    meta = r["meta_info"]
    return dict(
        output_ids=r["output_ids"],
        cached=meta["cached_tokens"],
        details=meta.get("cached_tokens_details") or {},
        prompt=meta["prompt_tokens"],
    )


def workload(server, model, record_dir, corrupt):
    def mark():
        return [len(r) for r in load_record.read(record_dir, TP)]

    out = dict(eviction=[one(server, t) for t in prompts(23, 4, 2)])
    marks = [mark()]
    texts = prompts(41, 4, 2)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out["concurrent"] = list(pool.map(lambda t: one(server, t), texts))
    out["capacity"] = [one(server, t) for t in prompts(57, 8, 3)]
    # a prompt, then two more (1200 tokens: it leaves the device pool), then
    # it again: its prefix is loaded back from the host tier
    texts = prompts(71, 3, 1)
    out["negative"] = [one(server, t) for t in texts[:-1]]
    marks.append(mark())
    if corrupt:
        (Path(record_dir) / TRIGGER[model]).touch()
    out["negative"].append(one(server, texts[-1]))
    out["trigger_left"] = (Path(record_dir) / TRIGGER[model]).exists()
    records = load_record.read(record_dir, TP)
    out["record_eviction"] = [r[: marks[0][i]] for i, r in enumerate(records)]
    out["record_negative"] = [r[marks[1][i] :] for i, r in enumerate(records)]
    log = server.log_text()
    out["host_pool_tokens"] = [
        int(n)
        for n in re.findall(
            r"Allocating kv hierarchical KV host pool: (\d+) tokens", log
        )
    ]
    out["owners"] = re.findall(
        r"HiCache rank shard: rank (\d)/2 owns KV layers (\[[\d, ]*\])"
        r"(?: and indexer layers (\[[\d, ]*\]))?",
        log,
    )
    out["errors"] = log.count("HiCache rank shard verify")
    return out


def shard_files(storage_dir) -> dict:
    """Rank -> {file name: size} of the rank-sharded objects in a directory."""
    out = {0: {}, 1: {}}
    for name in os.listdir(storage_dir):
        m = SHARD_FILE.match(name)
        if m:
            out[int(m.group(3))][name] = os.path.getsize(Path(storage_dir) / name)
    return out


def l3_counters(server) -> dict:
    """(tp_rank, direction) -> bytes, from the server's /metrics."""
    text = server.get("/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith(L3_METRIC + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            out[(int(labels["tp_rank"]), labels["direction"])] = int(
                float(line.rsplit(" ", 1)[1])
            )
    return out


def l3_settled(server, storage_dir, timeout=60.0, base=None) -> dict:
    """Waits until every rank's written-bytes counter covers its shard files
    on disk beyond ``base`` (rank -> bytes already there), i.e. the backups of
    the workload have landed, at most ``timeout``; returns the last counters
    and files either way."""
    deadline = time.monotonic() + timeout
    while True:
        counters, files = l3_counters(server), shard_files(storage_dir)
        grown = {r: sum(f.values()) - (base or {}).get(r, 0) for r, f in files.items()}
        if all(counters.get((r, "written")) == grown[r] for r in (0, 1)):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return dict(counters=counters, files=files)


def serve(model, name, env, storage_dir):
    record_dir = tempfile.mkdtemp(prefix=f"load-record-{model}-{name}-")
    env = dict(env, **{load_record.ENV: record_dir, STORAGE_DIR_ENV: storage_dir})
    args = ARGS + L3_ARGS + WRITE_ONLY
    t0 = time.monotonic()
    server = LiveServer("patched", args, env=env, name=f"{model}-{name}", model=model)
    t1 = time.monotonic()
    try:
        out = workload(server, model, record_dir, corrupt=name == "sharded")
        if name == "sharded":
            out["l3"] = l3_settled(server, storage_dir)
        if (model, name) == FAULT_SERVER:
            # End of life: one TP rank's scheduler killed under 8 streams.
            victim = server.roles()["sglang::scheduler_TP1"]
            out["fault"] = kill_during_streams(
                server.base_url, server.pids(), victim, FAULT_TOKENS
            )
            out["fault"]["port"] = port_release(server.port)
    except Exception as exc:
        raise RuntimeError(f"{model} {name}: {exc}\n{server.log_tail()}") from exc
    finally:
        t2 = time.monotonic()
        assert_all_gone(server.stop())
    out["seconds"] = dict(start=t1 - t0, workload=t2 - t1, stop=time.monotonic() - t2)
    return out


def restart(model, storage_dir):
    """The sharded server again, alone, on the first run's directory: it
    revisits the eviction workload's first four prompts from L3. Before the
    last one, rank 1's KV shard of its page ending at DELETED_AT is deleted."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    texts = prompts(23, 4, 2)[:4]
    env = dict(SHARDED, **{STORAGE_DIR_ENV: storage_dir})
    t0 = time.monotonic()
    server = LiveServer(
        "patched", ARGS + L3_ARGS, env=env, name=f"{model}-restart", model=model
    )
    t1 = time.monotonic()
    try:
        out = dict(before=l3_settled(server, storage_dir, timeout=0))
        out["revisits"] = [one(server, t) for t in texts[:-1]]
        ids = server.post_raw("/tokenize", {"prompt": texts[-1]}).json()["tokens"]
        page = PAGE[model]
        hashes = get_storage_hash_str(ids, None, page_size=page)
        doomed = DELETED_AT[model] // page  # the page after the last kept one
        out["deleted"] = [
            n
            for n in os.listdir(storage_dir)
            if n.startswith(hashes[doomed] + "_") and n.endswith("-r1.bin")
        ]
        for n in out["deleted"]:
            os.remove(Path(storage_dir) / n)
        out["start"] = l3_settled(server, storage_dir, timeout=0)
        out["revisits"].append(one(server, texts[-1]))
        base = {r: sum(f.values()) for r, f in out["start"]["files"].items()}
        out["end"] = l3_settled(server, storage_dir, base=base)
        out["errors"] = server.log_text().count("HiCache rank shard verify")
    except Exception as exc:
        raise RuntimeError(f"{model} restart: {exc}\n{server.log_tail()}") from exc
    finally:
        t2 = time.monotonic()
        assert_all_gone(server.stop())
    out["seconds"] = dict(start=t1 - t0, workload=t2 - t1, stop=time.monotonic() - t2)
    return out


def run_pair(model, storage):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sharded = pool.submit(serve, model, "sharded", SHARDED, storage["sharded"])
        replicated = pool.submit(
            serve, model, "replicated", REPLICATED, storage["replicated"]
        )
        out = dict(sharded=sharded.result(), replicated=replicated.result())
        out["restart"] = restart(model, storage["sharded"])
        return out


class RankShardServerChecks:
    MODEL = ""
    runs: dict = {}

    @classmethod
    def setUpClass(cls):
        cls.storage = {
            name: tempfile.mkdtemp(prefix=f"hicache-l3-{cls.MODEL}-{name}-")
            for name in ("sharded", "replicated")
        }
        for d in cls.storage.values():
            cls.addClassCleanup(shutil.rmtree, d, ignore_errors=True)
        cls.runs = run_pair(cls.MODEL, cls.storage)

    def aligned(self, tokens):
        return tokens // PAGE[self.MODEL] * PAGE[self.MODEL]

    def test_every_rank_owns_its_layers(self):
        owners = sorted(self.runs["sharded"]["owners"])
        indexer = {"tiny-mla": "", "tiny-dsa": "[0, 2]"}[self.MODEL]
        other = {"tiny-mla": "", "tiny-dsa": "[1, 3]"}[self.MODEL]
        self.assertEqual(owners, [("0", "[0, 2]", indexer), ("1", "[1, 3]", other)])
        self.assertEqual(self.runs["replicated"]["owners"], [])
        self.assertEqual(self.runs["sharded"]["errors"], 0)

    def test_host_capacity_from_the_geometry(self):
        # ratio x device tokens, plus one padding page; sharded: the same host
        # bytes hold LAYERS / ceil(LAYERS / TP) times the tokens.
        page = PAGE[self.MODEL]
        replicated = DEVICE_TOKENS * RATIO + page
        sharded = DEVICE_TOKENS * RATIO * LAYERS // -(-LAYERS // TP) + page
        self.assertEqual(self.runs["replicated"]["host_pool_tokens"], [replicated] * TP)
        self.assertEqual(self.runs["sharded"]["host_pool_tokens"], [sharded] * TP)

    def test_same_outputs_cache_hits_and_rows_as_replicated(self):
        ours, theirs = self.runs["sharded"], self.runs["replicated"]
        self.assertEqual(ours["eviction"], theirs["eviction"])
        for r in ours["eviction"][-2:]:  # the whole prefix from the host tier
            self.assertGreaterEqual(
                r["details"].get("host", 0), self.aligned(PROMPT_WORDS) - 8, r
            )
        for kind in ("concurrent", "capacity"):
            self.assertEqual(
                [r["output_ids"] for r in ours[kind]],
                [r["output_ids"] for r in theirs[kind]],
                kind,
            )
        # the rows attention read for every cached prefix, on both ranks
        self.assertEqual(ours["record_eviction"], theirs["record_eviction"])
        for rank in ours["record_eviction"]:
            loaded = [e for e in rank if e["prefix"] >= self.aligned(PROMPT_WORDS)]
            self.assertEqual(len(loaded), 2 * LAYERS, rank)  # 2 revisits x layers
            if self.MODEL == "tiny-dsa":
                self.assertTrue(all("index_k" in e for e in rank))

    def test_capacity_gain_shown_live(self):
        def host(run):
            return sum(r["details"].get("host", 0) for r in run["capacity"][-3:])

        def computed(run):
            return sum(r["prompt"] - r["cached"] for r in run["capacity"][-3:])

        ours, theirs = self.runs["sharded"], self.runs["replicated"]
        print(f"{self.MODEL} seconds: {ours['seconds']} / {theirs['seconds']}")
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

    def test_zeroed_owner_page_shows_in_the_record(self):
        # Negative control of the record check: rank 0 zeroed one host page
        # of layer 0 (its own) before the load-back; both ranks read it, rank
        # 1 through the owner's broadcast, and nothing else differs.
        ours, theirs = self.runs["sharded"], self.runs["replicated"]
        self.assertFalse(ours["trigger_left"], "the corrupted load-back never ran")
        host = ours["negative"][-1]["details"].get("host", 0)
        self.assertGreaterEqual(host, self.aligned(PROMPT_WORDS) - 8)
        differing = set()
        for rank, (a, b) in enumerate(
            zip(ours["record_negative"], theirs["record_negative"])
        ):
            self.assertEqual(len(a), len(b))
            self.assertEqual(len(a), LAYERS)  # one revisit, every layer
            for x, y in zip(a, b):
                for field in x:
                    if x[field] != y[field]:
                        differing.add((rank, x["layer"], field))
        self.assertEqual(
            differing, {(0, 0, FIELD[self.MODEL]), (1, 0, FIELD[self.MODEL])}
        )

    # ------------------------------------------------------------------ L3
    def shard_bytes(self) -> dict:
        """One page of a rank's shard object, per kind (KV, DSA indexer), from
        the geometry: upstream's object of the page (the replicated server's,
        every layer) holds LAYERS layers, each rank owns LAYERS / TP of them
        (test_every_rank_owns_its_layers); no draft layers are packed."""
        full = {}
        for n in os.listdir(self.storage["replicated"]):
            m = REPLICATED_FILE.match(n)
            if m:
                full[bool(m.group(2))] = os.path.getsize(
                    Path(self.storage["replicated"]) / n
                )
        self.assertEqual(
            set(full), {False, True} if self.MODEL == "tiny-dsa" else {False}
        )
        return {kind: size * (LAYERS // TP) // LAYERS for kind, size in full.items()}

    def test_l3_every_rank_stores_its_own_share_once(self):
        share = self.shard_bytes()
        l3 = self.runs["sharded"]["l3"]
        pages = []
        for rank in (0, 1):
            files = l3["files"][rank]
            self.assertTrue(files, rank)
            for name, size in files.items():
                indexer = SHARD_FILE.match(name).group(2) is not None
                self.assertEqual(size, share[indexer], name)
            pages.append({SHARD_FILE.match(n).group(1, 2) for n in files})
            # the counter: this rank's objects, each written once
            self.assertEqual(l3["counters"].get((rank, "written")), sum(files.values()))
            self.assertEqual(l3["counters"].get((rank, "read")), 0)  # no prefetch yet
        # every page has both ranks' shards and nothing else: stored once
        self.assertEqual(pages[0], pages[1])
        others = [
            n
            for n in os.listdir(self.storage["sharded"])
            if n.endswith(".bin") and not SHARD_FILE.match(n)
        ]
        self.assertEqual(others, [])

    def test_l3_restart_serves_revisits_from_storage(self):
        share = self.shard_bytes()
        rs, theirs = self.runs["restart"], self.runs["replicated"]
        print(f"{self.MODEL} restart seconds: {rs['seconds']}")
        print(
            f"{self.MODEL} restart revisits: {[r['details'] for r in rs['revisits']]}"
        )
        print(f"{self.MODEL} restart L3 counters: {rs['end']['counters']}")
        # the same outputs as the replicated server computed in the first run
        self.assertEqual(
            [r["output_ids"] for r in rs["revisits"]],
            [r["output_ids"] for r in theirs["eviction"][:4]],
        )
        for r in rs["revisits"][:-1]:
            self.assertGreater(r["details"].get("storage", 0), 0, r)
            self.assertGreaterEqual(r["cached"], self.aligned(PROMPT_WORDS) - 8, r)
        # rank 1's shard of one page deleted: a miss from that page on, on
        # both ranks (each read only the pages before it, below)
        self.assertEqual(len(rs["deleted"]), 1, rs["deleted"])
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
            before = rs["before"]["files"][rank]
            gone = sum(before[n] for n in rs["deleted"] if n in before)
            grown = sum(rs["end"]["files"][rank].values()) - sum(before.values())
            written = rs["end"]["counters"].get((rank, "written"))
            self.assertEqual(written, grown + gone, rank)
        self.assertEqual(rs["errors"], 0)


class TestRankShardServerMLA(RankShardServerChecks, unittest.TestCase):
    MODEL = "tiny-mla"

    def test_a_killed_tp_rank_ends_every_stream_and_the_server(self):
        # SIGKILL of scheduler TP1 under 8 streams: the survivor's collective
        # fails, the launcher stops the tree; every stream ends in an error
        # (none can finish: the model is split over both ranks), nothing hangs.
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


if __name__ == "__main__":
    unittest.main()
