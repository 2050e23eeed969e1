"""PD disaggregation on CPU: a prefill server and decode servers with the
seed's decode-HiCache interface, KV moved by mooncake over TCP.

0.5.23 ships five transfer backends; on a CPU machine only ``mooncake_tcp``
(``mooncake-transfer-engine-non-cuda``, ``MC_FORCE_TCP``) moves KV: ``fake``
is refused by prefill servers, ``nixl`` registers the KV pool as VRAM (UCX
without CUDA refuses it), ``mori`` and ``ascend`` need ROCm / NPU.  Two CPU
gaps of the prefill's send path are bridged: the pinned-memory page-index
staging (``tests/standins/cpu_server_standins.py``) and the early send of cached
prefixes, which records a ``torch.cuda.Event``
(``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=false``).

Requests are sent the way sglang's mini load balancer sends them: the same body
with ``bootstrap_host/port/room`` to both servers at once, the answer taken
from the decode server.  The model is the tiny DeepSeek-V3 (plain MLA), served
as DeepSeek deployments serve it: decode workers with DP attention.  The prefill
server runs with ``--disable-radix-cache``: every hit a request reports is the
decode worker's own.  A second prefill server with HiCache (``prefill-l3``)
serves one phase only: prefill and decode on one Mooncake store, where the
decode worker puts a turn's pages (the tokens it generated included) and
prefill finds them for the next turn (``prefill_l3_phase``).  Three decode
workers with a 640-token device pool per rank and a host tier twice that serve
from the one prefill server:

* ``seed``: two DP ranks with DP attention (``--tp 2 --dp-size 2
  --enable-dp-attention``, where 0.5.23 warns "Decode radix cache with DP
  attention. Requires prefix-aware DP rank routing for optimal cache hits.")
  with ``--disaggregation-decode-enable-radix-cache
  --disaggregation-decode-enable-hicache --disaggregation-decode-hicache-ratio
  2.0``; it auto-selects cache_aware routing;
* ``generic``: one rank (no DP), the same wheel with upstream's generic
  spelling (``--enable-hierarchical-cache --hicache-ratio 2.0
  --disaggregation-decode-enable-radix-cache``) and the default
  ``--load-balance-method auto``, which resolves to round_robin there: the
  scheduler keeps 0.5.23's admission, which it says by not logging the seed
  interface's, and refuses what its pool can never admit.  Its greedy outputs
  are not compared with the seed worker's: without DP attention the MLP runs
  unsharded, and the tiny model's near-tied logits pick other tokens;
* ``sharded``: two TP ranks (no DP attention) with rank shard on
  (``SGLANG_ENABLE_HICACHE_RANK_SHARD=1``) and the seed interface; it serves
  the L3 phase only (``sharded_phase``): its ranks' shard objects of a
  prompt's pages, and the revisit restored from them by the agreed two-phase
  prefetch, bit for bit.

Workload: prompts A and B (one per rank), eight fillers (A and B leave their
ranks' device pools for the host tier: three 208-token requests fill a pool),
then B and A again.  Round-robin sends request i to rank i % 2, so the
revisits (requests 10 and 11) go to the ranks that do not hold them; the seed
worker must send each to its holder, which restores it from its host tier
(``load_back_tokens_total``), and reports those tokens as host hits in
``cached_tokens_details`` (0.5.23's decode reports them as device hits,
fixes/0008).  The control runs on the seed worker after it: the same workload
under another ``extra_key`` (a namespace of the radix tree and of the router:
nothing of the seed run matches it), each request sent to rank i % 2 as
round-robin would (``routed_dp_rank`` in the decode server's body, which its DP
controller honours before cache_aware; the prefill server, one rank, gets the
body without it).  It must miss the revisits and give the seed run's greedy
outputs, hit or miss.

Then the seed worker gets a burst: two requests of one new prompt posted to it,
and to prefill only once its routing counters show both routed among its DP
ranks (``wait_routed``, at most ``BURST_ROUTED_S``), so both are routed before
either transfer could land. A decode rank reuses transferred KV only
once its prebuilt batch put it in its tree, which its DP leader reports as a
landing (cache-aware-routing/0008): both are routed as misses, by load; a
prefix credited from its dispatch sent the second to the first's rank by its
match.

Then each decode worker gets a prompt that passes its input-length check but
needs more than its whole pool with the reserved decode tokens, posted to both
servers at once as a router posts it, then again to prefill once decode has
answered: decode answers HTTP 400 naming the sizes, prefill answers within
``PREFILL_FREED_S`` (it was told, also when decode's abort came before the
request, fixes/0013), and both serve the next request (0.5.23 keeps it queued
forever and prefill waits for its bootstrap timeout, fixes/0007; 0.5.23's
prefill drops an abort that beats the request).
"""

import json
import random
import re
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

import requests
from sglang.test.ci.ci_register import register_cpu_ci

from harness import mooncake_l3
from harness.greedy_ties import TOP2, first_divergence, top2_of
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
from harness.live_server import LiveServer, assert_all_gone, free_port, greedy
from harness.metrics import l3_counters, routing_outcomes, total
from harness.pd_stall import PD_DEBUG_ENV, StallWatch, stall_bound

register_cpu_ci(est_time=300, suite="base-b-test-cpu")
FEATURE_GROUP = "decode-hicache"  # the series group it tests (or "series")
PROJECT_ONLY = "runs this project's CPU server (stand-ins, local tiny model)"

PD_ENV = {
    # mooncake registers this address (else the first NIC's).
    "SGLANG_HOST_IP": "127.0.0.1",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "false",
    # harness.pd_stall: the transfer engine's and the disaggregation modules'
    # debug logs, read when a request stalls
    **PD_DEBUG_ENV,
}
TRANSFER = ["--disaggregation-transfer-backend", "mooncake_tcp"]
MODEL = "tiny-mla"
DP_ATTENTION = ["--tp", "2", "--dp-size", "2", "--enable-dp-attention"]
DECODE_POOL = 640  # tokens per decode rank
PROMPT_WORDS = 200  # one token per word with the tiny tokenizer
NEW_TOKENS = 8  # a finished request keeps 208 tokens: 3 fill a device pool
FILLERS = 8  # about 4 per rank after A or B: both leave the device, not the host
HICACHE_IO = ["--hicache-io-backend", "direct", "--hicache-mem-layout"]
HICACHE_IO += ["page_first_direct"]
DECODE_BASE = [
    "--disaggregation-mode",
    "decode",
    *TRANSFER,
    "--max-total-tokens",
    str(DECODE_POOL),
    # A request is admitted once its prompt plus this many decode tokens fit
    # (default 512: with a 640-token pool no 200-token prompt ever would).
    "--num-reserved-decode-tokens",
    "16",
    "--enable-metrics",
    *HICACHE_IO,
    # /attach_hicache_storage_backend and /flush_cache (the L3 phase)
    "--admin-api-key",
    "pd-l3-admin",
]
ADMIN = {"Authorization": "Bearer pd-l3-admin"}
SEED_FLAGS = [
    # The burst decodes on both ranks at once: with equal batches the TP LM
    # head's all-to-all (on by default for a pure-DP decode node) runs, and
    # sglang::reg_all_to_all_single has no CPU kernel.
    "--no-enable-tp-lm-head-all-to-all",
    # 64-token digest chunks (the default, named here because the test
    # needs it): a 200-token prompt spans three; 256-token chunks would
    # leave every prompt here invisible to the router
    "--dp-routing-digest-chunk-size",
    "64",
    "--disaggregation-decode-enable-radix-cache",
    "--disaggregation-decode-enable-hicache",
    "--disaggregation-decode-hicache-ratio",
    "2.0",
]
GENERIC_FLAGS = ["--enable-hierarchical-cache", "--hicache-ratio", "2.0"]
GENERIC_FLAGS += ["--disaggregation-decode-enable-radix-cache"]
# name: decode arguments (all on the patched wheel)
DECODES = {
    "seed": DECODE_BASE + DP_ATTENTION + SEED_FLAGS,
    "generic": DECODE_BASE + GENERIC_FLAGS,
}
# A rank-sharded decode worker (hicache-rank-shard): TP=2 without DP
# attention (its two ranks one shard group, each holding 2 of the 4 layers in
# its host pool and its L3 objects), the seed interface, L3 attached at
# runtime like the others; each load-back vote also compares the two ranks'
# radix trees (VERIFY_EVERY=1). Only the L3 phase runs on it (``sharded_phase``).
SHARDED_DECODE = DECODE_BASE + ["--tp", "2"] + SEED_FLAGS[-4:]
SHARDED_ENV = {
    **PD_ENV,
    "SGLANG_ENABLE_HICACHE_RANK_SHARD": "1",
    "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "1",
}
LAYERS, SHARD = 4, 2  # tiny-mla's layers; the sharded worker's TP ranks
# The control's namespace on the seed worker (see the module docstring).
CONTROL_KEY = "round-robin-control"
# What the decode scheduler logs at startup when it runs the seed interface's
# admission (decode-hicache/0004).
SEED_ADMISSION_LOG = (
    "Decode HiCache admission (--disaggregation-decode-enable-hicache): "
    "pre-allocation planned per round"
)
WORDS = "cache prefix token rank host device page layer tree radix decode".split()


# decode bodies first, prefill's once both are routed (no transfer before)
BURST_ROUTED_S = 60.0
BURST_KEY = "decode-landing-burst"  # a namespace no other request shares
# Every PD request below is watched (harness.pd_stall): one still unanswered
# after the bound of its workload gets the servers' thread dumps and the
# transfer engine's log, printed and attached to the class setup's failure.
# setUpClass names the servers.
STALLS = StallWatch({}, stall_bound(1, NEW_TOKENS))


def delta(after: dict, before: dict) -> dict:
    keys = set(after) | set(before)
    return {
        k: after.get(k, 0) - before.get(k, 0)
        for k in keys
        if after.get(k, 0) != before.get(k, 0)
    }


def wait_routed(server, total: float, timeout: float) -> float:
    """Waits until ``server``'s DP controller has routed ``total`` requests in
    all (``sglang:dp_routing_requests_total``, every outcome); the seconds it
    took."""
    start = time.monotonic()
    while True:
        routed = sum(routing_outcomes(server).values())
        if routed >= total:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise RuntimeError(
                f"{routed:g} of {total:g} requests routed after {timeout:g} s"
            )
        time.sleep(0.05)


def pd_burst(prefill, decode, bootstrap_port, text, copies, routed_s) -> list:
    """``copies`` requests of ``text`` (under ``BURST_KEY``), each posted to
    the decode worker, and to prefill once the decode worker has routed all
    of them (at most ``routed_s``); the decode answers' meta."""
    bodies = [
        {
            "text": text,
            "sampling_params": greedy(NEW_TOKENS),
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.randint(0, 2**62),
            "extra_key": BURST_KEY,
        }
        for _ in range(copies)
    ]
    rooms = [b["bootstrap_room"] for b in bodies]
    bound = routed_s + stall_bound(copies, NEW_TOKENS)
    routed = sum(routing_outcomes(decode).values())
    with STALLS.watch(f"burst, rooms {rooms}", bound), ThreadPoolExecutor(
        2 * copies
    ) as pool:
        ds = [pool.submit(decode.post_raw, "/generate", b) for b in bodies]
        waited = wait_routed(decode, routed + copies, routed_s)
        print(f"burst: {copies} requests routed by decode in {waited:.2f} s")
        ps = [pool.submit(prefill.post_raw, "/generate", b) for b in bodies]
        answers = [d.result() for d in ds]
        for p in ps:
            assert p.result().status_code == 200, p.result().text[:300]
    for a in answers:
        assert a.status_code == 200, a.text[:300]
    return [a.json()["meta_info"] for a in answers]


def pd_generate(
    prefill,
    decode,
    bootstrap_port,
    text,
    extra_key=None,
    rank=None,
    logprobs=False,
    with_prefill=False,
):
    """``text``: a string or token ids. ``rank``: the decode server's DP rank
    (``routed_dp_rank`` in its body only: the prefill server has one rank).
    ``logprobs``: each output token's two best logprobs too (``TOP2``).
    ``with_prefill``: (prefill's answer, decode's answer)."""
    body = {
        **({"input_ids": text} if isinstance(text, list) else {"text": text}),
        "sampling_params": greedy(NEW_TOKENS),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.randint(0, 2**62),
        **(TOP2 if logprobs else {}),
    }
    if extra_key is not None:
        body["extra_key"] = extra_key
    decode_body = dict(body) if rank is None else {**body, "routed_dp_rank": rank}
    what = f"room {body['bootstrap_room']} (decode rank {rank})"
    with STALLS.watch(what), ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.post_raw, "/generate", body)
        d = pool.submit(decode.post_raw, "/generate", decode_body)
        p_resp, d_resp = p.result(), d.result()
    if d_resp.status_code != 200:
        return {"error": (d_resp.status_code, d_resp.text[:300])}
    assert p_resp.status_code == 200, p_resp.text[:500]
    return (p_resp.json(), d_resp.json()) if with_prefill else d_resp.json()


# Decode admission charges --num-reserved-decode-tokens on top of a request's KV:
# a prompt of this many tokens passes the decode scheduler's input-length check
# (pool - 6) but needs more than the whole pool with the reservation
# (fixes/0007; 0.5.23 keeps it queued forever).
OVERSIZED_WORDS = DECODE_POOL - 12
OVERSIZED_TIMEOUT_S = 60.0  # both answers are immediate; 0.5.23 never answers
# Prefill answers a request whose decode abort it got within this many seconds
# of its post: the abort fails the request's sender at its first bootstrap-queue
# poll, a scheduler round (milliseconds idle, a few seconds on a loaded CI
# machine). A dropped abort leaves it to prefill's bootstrap timeout (300 s,
# SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT), twenty times this bound.
PREFILL_FREED_S = 15.0
NOT_FREED = "prefill not freed"  # both assertions of that claim name it


def prefill_bootstrapping(prefill) -> int:
    """Requests in the prefill server's bootstrap queue: each holds its
    bootstrap room (its KV sender exists)."""
    loads = prefill.get("/v1/loads?include=disagg").json()["loads"]
    return sum(x["disaggregation"]["prefill_bootstrap_queue_reqs"] for x in loads)


def pd_generate_both(prefill, decode, bootstrap_port, text, decode_first=False):
    """Both servers' answers (status, body head, seconds from its own post;
    status None on timeout) and the prefill bootstrap queue after both.

    Posted to both at once, as a router posts (decode's abort may reach
    prefill before or after prefill created the request's sender), or with
    ``decode_first`` to prefill once decode has answered, so decode's abort
    (sent before its answer) reaches prefill before the request does."""
    body = {
        "text": text,
        "sampling_params": greedy(NEW_TOKENS),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.randint(0, 2**62),
    }

    def post(server):
        start = time.monotonic()
        try:
            r = server.post_raw("/generate", body, timeout=OVERSIZED_TIMEOUT_S)
        except requests.Timeout:
            return (None, "no answer", time.monotonic() - start)
        return (r.status_code, r.text[:600], time.monotonic() - start)

    what = f"oversized, room {body['bootstrap_room']}"
    with STALLS.watch(what), ThreadPoolExecutor(2) as pool:
        d = pool.submit(post, decode)
        if decode_first:
            d.result()
        p = pool.submit(post, prefill)
        both = dict(prefill=p.result(), decode=d.result())
    both["bootstrapping"] = prefill_bootstrapping(prefill)
    return both


# The capture's own check: a request posted to the seed worker's DP rank 1
# alone stalls by construction (prefill never computes it). It is watched
# with this bound and cut by the client a second later; the capture, taken
# while the request waits, must name every process of the three servers.
PROBE_BOUND_S = 2.0
PROBE_CLIENT_TIMEOUT_S = PROBE_BOUND_S + 1.0


def probe_stall_capture(decode, bootstrap_port) -> dict:
    body = {
        "text": "a request prefill never sees",
        "sampling_params": greedy(NEW_TOKENS),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.randint(0, 2**62),
        "routed_dp_rank": 1,
    }
    before = len(STALLS.captures)
    what = f"probe, room {body['bootstrap_room']} (decode rank 1, decode only)"
    with STALLS.watch(what, PROBE_BOUND_S):
        try:
            r = decode.post_raw("/generate", body, timeout=PROBE_CLIENT_TIMEOUT_S)
            answer = (r.status_code, r.text[:300])
        except requests.Timeout:
            answer = None
    servers = STALLS.servers.items()
    return dict(
        answer=answer,
        captures=STALLS.captures[before:],
        pids={name: server.pids() for name, server in servers},
        roles={name: server.roles() for name, server in servers},
    )


def loaded_back_tokens(server) -> float:
    """Tokens the decode worker restored from its host tier (all ranks)."""
    return total(server.get("/metrics").text, "sglang:load_back_tokens_total")


def workload() -> list[tuple[str, str]]:
    rng = random.Random(3)

    def prompt():
        return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))

    a, b = prompt(), prompt()
    order = [("A", a), ("B", b)] + [(f"f{i}", prompt()) for i in range(FILLERS)]
    return order + [("B again", b), ("A again", a)]


def run_workload(prefill, decode, bootstrap_port, round_robin=False) -> dict:
    """With ``round_robin``: the control (request i to DP rank i % 2, under
    ``CONTROL_KEY``)."""
    runs = {}
    for i, (name, text) in enumerate(workload()):
        before = loaded_back_tokens(decode)
        if round_robin:
            r = pd_generate(
                prefill, decode, bootstrap_port, text, CONTROL_KEY, rank=i % 2
            )
        else:
            r = pd_generate(prefill, decode, bootstrap_port, text)
        runs[name] = served(r)
        if "error" not in r:
            runs[name]["loaded_back"] = loaded_back_tokens(decode) - before
    return runs


STORE_SEGMENT = "256 MB"  # the L3 phase puts a few hundred KB
L3_MISS_KEY = "l3-phase-miss"  # a namespace nothing in the store has
L3_WRITTEN_S = 60.0  # the write-through of the first visit reaches the store


def admin_post(server, path, body=None, method="post"):
    return requests.request(
        method,
        f"{server.base_url}{path}",
        json=body or {},
        headers=ADMIN,
        timeout=120,
    )


def attach_l3(server, store) -> tuple:
    """Attaches the store to a running decode worker (every DP rank):
    ``wait_complete``, so a restore waits for its whole L3 prefetch, and
    write-through, so a served prefix reaches the store."""
    r = admin_post(
        server,
        "/hicache/storage-backend",
        {
            "hicache_storage_backend": "mooncake",
            # prefetch from 64 tokens on (upstream's default 256 would
            # leave every 200-token prompt here out of L3)
            "hicache_storage_backend_extra_config_json": json.dumps(
                store.extra_config(prefetch_threshold=64)
            ),
            "hicache_storage_prefetch_policy": "wait_complete",
            "hicache_write_policy": "write_through",
        },
        method="put",
    )
    return r.status_code, r.text[:300]


def page_objects(store) -> set:
    """Upstream's (unsharded) MLA page objects in the store (their keys)."""
    return set(mooncake_l3.objects(store)["replicated"])


def wait_objects(store, before: set, count: int, timeout: float) -> int:
    """Waits until ``count`` objects not in ``before`` are in the store (at
    most ``timeout``); how many there are."""
    deadline = time.monotonic() + timeout
    while (n := len(page_objects(store) - before)) < count:
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return n


def served(r) -> dict:
    """What a test reads of one PD answer (a refused one: its error, and no
    rank or hit, so that checks of those fail on their assertion)."""
    if "error" in r:
        return dict(
            error=r["error"], rank=None, cached=None, details={}, output_ids=None
        )
    meta = r["meta_info"]
    return dict(
        rank=meta.get("dp_rank"),
        cached=meta["cached_tokens"],
        prompt=meta["prompt_tokens"],
        details=meta.get("cached_tokens_details") or {},
        output_ids=r["output_ids"],
        **({"top2": top2_of(meta)} if "output_top_logprobs" in meta else {}),
    )


def l3_phase(prefill, decodes, bootstrap_port, store, text, page) -> dict:
    """Decode HiCache with L3 on one Mooncake store (runtime-attached, after
    the phases whose revisits must miss): the seed worker serves ``text``,
    its pages reach the store, its cache is flushed (device and host), and
    the revisit is restored L3 -> L2 -> L1 by the two-phase prefetch. Then
    the generic worker, another instance on the same store, serves ``text``
    under a namespace nothing stored has (a miss: prefill computes it all)
    and as is: from the seed worker's objects."""
    seed, generic = decodes["seed"], decodes["generic"]
    out = dict(attach={n: attach_l3(d, store) for n, d in decodes.items()})
    before = page_objects(store)
    out["first"] = served(pd_generate(prefill, seed, bootstrap_port, text))
    # a decode worker's tree holds the whole prompt (prefill sent every
    # token's KV): its whole pages go to the store
    full_pages = out["first"].get("prompt", 0) // page
    out["full_pages"] = full_pages
    out["objects_written"] = wait_objects(store, before, full_pages, L3_WRITTEN_S)
    flushed = admin_post(seed, "/flush_cache")
    out["flush"] = (flushed.status_code, flushed.text[:200])
    before = loaded_back_tokens(seed)
    out["revisit"] = served(pd_generate(prefill, seed, bootstrap_port, text))
    out["revisit"]["loaded_back"] = loaded_back_tokens(seed) - before
    out["generic_miss"] = served(
        pd_generate(prefill, generic, bootstrap_port, text, L3_MISS_KEY)
    )
    out["generic_shared"] = served(pd_generate(prefill, generic, bootstrap_port, text))
    out["store"] = store.stats()
    return out


# A prefill server with HiCache (radix cache, host tier) on the decode workers'
# store, attached at runtime like them. Only ``prefill_l3_phase`` sends to it,
# so every hit the other phases report stays the decode worker's own.
PREFILL_L3 = ["--disaggregation-mode", "prefill", *TRANSFER]
PREFILL_L3 += ["--enable-hierarchical-cache", "--hicache-ratio", "2.0", *HICACHE_IO]
PREFILL_L3 += ["--enable-metrics", "--admin-api-key", "pd-l3-admin"]
SECOND_TURN_WORDS = 30  # new words of the second turn
PREFILL_L3_MISS_KEY = "prefill-l3-miss"  # a namespace nothing in the store has
PREFILL_L3_SEED = 11  # its own words: the other phases' draws stay as they were


def prefill_l3_phase(
    prefill_l3, decode, bootstrap_port, store, text, page, rng
) -> dict:
    """Prefill and decode on one store: ``prefill_l3`` and ``decode`` (both
    L3 attached, write-through) serve a first turn; the decode worker puts
    the prompt's pages and those of the tokens it generated (their KV only
    it computed); prefill's cache is flushed (device and host), and the
    second turn (the first one's prompt and output, then new words, as token
    ids) finds on prefill, from the store, every token of the first turn
    that has KV. Returns both servers' answers of both turns."""
    out = dict(attach=attach_l3(prefill_l3, store))
    ids = prefill_l3.post_raw("/tokenize", {"prompt": text}).json()["tokens"]
    before = page_objects(store)
    p1, d1 = pd_generate(prefill_l3, decode, bootstrap_port, ids, with_prefill=True)
    out["first"] = dict(prefill=served(p1), decode=served(d1))
    out["prompt"] = len(ids)
    # the first turn's tokens with KV on the decode worker: the prompt and
    # every output token (the overlap scheduler runs the step after the
    # last token before it sees the request finished)
    out["with_kv"] = len(ids) + len(d1["output_ids"])
    out["objects_written"] = wait_objects(
        store, before, out["with_kv"] // page, L3_WRITTEN_S
    )
    flushed = admin_post(prefill_l3, "/flush_cache")
    out["flush"] = (flushed.status_code, flushed.text[:200])
    new = " ".join(rng.choice(WORDS) for _ in range(SECOND_TURN_WORDS))
    new_ids = prefill_l3.post_raw("/tokenize", {"prompt": new}).json()["tokens"]
    turn2 = ids + d1["output_ids"] + new_ids
    p2, d2 = pd_generate(
        prefill_l3, decode, bootstrap_port, turn2, logprobs=True, with_prefill=True
    )
    out["second"] = dict(prefill=served(p2), decode=served(d2))
    # the second turn computed whole (a namespace nothing stored has)
    out["reference"] = served(
        pd_generate(
            prefill_l3,
            decode,
            bootstrap_port,
            turn2,
            PREFILL_L3_MISS_KEY,
            logprobs=True,
        )
    )
    return out


# After the flush, prompts that fill the sharded worker's device pool (3 x 208
# tokens of 640): the device and host slots the first visit freed then hold
# other KV, so a restore that wrote nothing would not find the first visit's
# bytes left in them.
SHARDED_FILLERS = DECODE_POOL // (PROMPT_WORDS + NEW_TOKENS)
SHARDED_FILLER_KEY = "sharded-fillers"  # a namespace of their own
# What a shard group logs when its ranks are found apart (each fails the request)
DIVERGED = ("HiCache rank shard verify", "HiCache rank shard: the radix trees")


def sharded_phase(prefill, sharded, bootstrap_port, store, text, page, rng) -> dict:
    """The rank-sharded decode worker on the store: L3 attached at runtime;
    it serves ``text`` (the L3 phase's prompt, whose upstream objects the
    seed worker put), its write-through puts each rank's shard of every full
    page; once they landed (every shard there, each rank's written bytes
    equal to its objects' growth), its cache is flushed, fillers take the
    freed slots, and the revisit is restored L3 -> L2 -> L1 by the two-phase
    prefetch the shard group agrees on. Returns both answers (with their
    top-2 logprobs), the objects of the prompt's pages and the L3 byte
    counters before and after the revisit."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    out = dict(attach=attach_l3(sharded, store))
    ids = sharded.post_raw("/tokenize", {"prompt": text}).json()["tokens"]
    hashes = get_storage_hash_str(ids, None, page_size=page)[: len(ids) // page]
    now = mooncake_l3.settled(sharded, store, timeout=0)
    out["base"] = {r: sum(now["objects"].get(r, {}).values()) for r in range(SHARD)}
    out["first"] = served(
        pd_generate(prefill, sharded, bootstrap_port, text, logprobs=True)
    )
    out["settled"] = mooncake_l3.settled(
        sharded, store, L3_WRITTEN_S, base=out["base"], pages=hashes
    )
    keys = store.keys()
    sizes = store.sizes(keys)
    out["pages"] = [
        {k: sizes.get(k) for k in mooncake_l3.page_objects(keys, h, "k")}
        for h in hashes
    ]
    flushed = admin_post(sharded, "/flush_cache")
    out["flush"] = (flushed.status_code, flushed.text[:200])
    out["fillers"] = [
        served(
            pd_generate(
                prefill,
                sharded,
                bootstrap_port,
                " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS)),
                SHARDED_FILLER_KEY,
            )
        )
        for _ in range(SHARDED_FILLERS)
    ]
    out["read_before"] = l3_counters(sharded)
    out["revisit"] = served(
        pd_generate(prefill, sharded, bootstrap_port, text, logprobs=True)
    )
    out["read_after"] = l3_counters(sharded)
    log = sharded.log_text()
    out["diverged"] = sum(log.count(line) for line in DIVERGED)
    out["owners"] = re.findall(
        r"HiCache rank shard: rank (\d)/(\d) owns KV layers (\[[\d, ]*\])", log
    )
    return out


# What fixes/0024 logs, once per change of the store's condition: the master
# stopped is RPC_FAIL; the segment client stopped, once the master dropped its
# segment, leaves no segment to put into (NO_AVAILABLE_HANDLE).
L3_DOWN_LINES = {
    "master": "Mooncake L3 master unreachable (RPC_FAIL)",
    "client": "Mooncake L3 no space (NO_AVAILABLE_HANDLE",
}
L3_LINE = "] Mooncake L3 "
L3_BACK_LINE = "Mooncake L3 back after "
L3_QUIET_S = 5.0  # fixes/0024's RECOVERED_QUIET_S
L3_BACK_TRIES = 8


def fault_phase(prefill, decode, bootstrap_port, store, rng, page) -> dict:
    """The store's parts taken away and brought back while ``decode`` (L3
    attached) serves: the master stopped, two new prompts, the master
    started again (the client mounts its segment on it) and one more prompt
    whose pages must reach the store, then another once the recovery's quiet
    period passed; the same with the segment client (stopped and dropped by
    the master). Returns per part each answer, the seconds each took, the
    objects stored after the recovery and the decode's L3 log lines of the
    part."""

    def prompt():
        return " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))

    def ask():
        start = time.monotonic()
        r = served(pd_generate(prefill, decode, bootstrap_port, prompt()))
        r["seconds"] = round(time.monotonic() - start, 2)
        return r

    def ask_stored():
        before = page_objects(store)
        r = ask()
        full = r.get("prompt", 0) // page
        r["stored"] = wait_objects(store, before, full, L3_WRITTEN_S)
        r["full"] = full
        return r

    def l3_lines():
        # the server's log is its stdout and stderr, one after the other:
        # the L3 lines (one stream) are only ever appended to
        return [x for x in decode.log_text().splitlines() if L3_LINE in x]

    out = {}
    for part, stop, start in (
        ("master", store.stop_master, store.start_master),
        ("client", store.stop_client, store.start_client),
    ):
        mark = len(l3_lines())
        stop()
        if part == "client":
            store.wait_unmounted()
        down = [ask(), ask()]
        start()
        store.wait_mounted()
        back = ask_stored()
        # the recovery is logged at the first success a quiet period after
        # the last failure (fixes/0024); calls issued while the part was
        # away may still be failing (each waits for its timeout): prompts
        # a quiet period apart until the line is there
        for _ in range(L3_BACK_TRIES):
            time.sleep(L3_QUIET_S + 1)
            after = ask_stored()
            if any(L3_BACK_LINE in x for x in l3_lines()[mark:]):
                break
        out[part] = dict(down=down, back=back, after=after)
        out[part]["lines"] = l3_lines()[mark:]
    return out


class TestPdDecodeHiCacheServer(unittest.TestCase):
    results: dict = {}

    @classmethod
    def setUpClass(cls):
        bootstrap_port = free_port()
        store = mooncake_l3.MooncakeStore(segment=STORE_SEGMENT)
        cls.addClassCleanup(cls.stop_store, store)
        prefill_args = ["--disaggregation-mode", "prefill", *TRANSFER]
        prefill_args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        prefill_args += ["--disable-radix-cache"]
        prefill = LiveServer(
            "patched", prefill_args, env=PD_ENV, name="prefill", model=MODEL
        )
        STALLS.servers["prefill"] = prefill
        l3_bootstrap_port = free_port()
        decodes, pids = {}, []
        # The seed worker's KV events, one publisher per DP rank (port + rank),
        # subscribed before it binds.
        events_port = publisher_port(ranks=2)
        subs = [Subscriber(f"tcp://127.0.0.1:{events_port + r}") for r in range(2)]
        events = ["--kv-events-config", events_config(events_port)]

        # servers of one phase each, stopped once it is done
        phased = {}

        def start(name):
            if name == "prefill-l3":
                args = PREFILL_L3 + [
                    "--disaggregation-bootstrap-port",
                    str(l3_bootstrap_port),
                ]
                server = LiveServer("patched", args, env=PD_ENV, name=name, model=MODEL)
                phased[name] = server
                STALLS.servers[name] = server
                return
            server = LiveServer(
                "patched",
                (DECODES | {"sharded": SHARDED_DECODE})[name]
                + (events if name == "seed" else []),
                env=SHARDED_ENV if name == "sharded" else PD_ENV,
                name=f"decode-{name}",
                model=MODEL,
            )
            (phased if name == "sharded" else decodes)[name] = server
            STALLS.servers[f"decode-{name}"] = server

        try:
            names = [*DECODES, "sharded", "prefill-l3"]
            with ThreadPoolExecutor(len(names)) as pool:
                for f in [pool.submit(start, n) for n in names]:
                    f.result()
            rng = random.Random(5)
            oversized = " ".join(rng.choice(WORDS) for _ in range(OVERSIZED_WORDS))
            seed = decodes["seed"]
            runs = run_workload(prefill, seed, bootstrap_port)
            for sub in subs:
                sub.settle()
            cls.results["events"] = [list(sub.records) for sub in subs]
            cls.results["page"] = seed.get("/server_info").json()["page_size"]
            before = routing_outcomes(seed)
            control = run_workload(prefill, seed, bootstrap_port, round_robin=True)
            cls.results["round_robin"] = dict(
                runs=control, outcomes=delta(routing_outcomes(seed), before)
            )
            before = routing_outcomes(seed)
            burst = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
            cls.results["burst"] = dict(
                meta=pd_burst(prefill, seed, bootstrap_port, burst, 2, BURST_ROUTED_S)
            )
            cls.results["burst"]["outcomes"] = delta(routing_outcomes(seed), before)
            l3_text = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
            page = cls.results["page"]
            cls.results["l3"] = l3_phase(
                prefill, decodes, bootstrap_port, store, l3_text, page
            )
            l3_rng = random.Random(PREFILL_L3_SEED)
            cls.results["prefill_l3"] = prefill_l3_phase(
                phased["prefill-l3"],
                decodes["generic"],
                l3_bootstrap_port,
                store,
                " ".join(l3_rng.choice(WORDS) for _ in range(PROMPT_WORDS)),
                page,
                l3_rng,
            )
            del STALLS.servers["prefill-l3"]
            pids += phased.pop("prefill-l3").stop()
            cls.results["sharded"] = sharded_phase(
                prefill, phased["sharded"], bootstrap_port, store, l3_text, page, rng
            )
            # its part done: stopped now (the probe names the others' processes)
            del STALLS.servers["decode-sharded"]
            pids += phased.pop("sharded").stop()
            cls.results["l3_faults"] = fault_phase(
                prefill, decodes["generic"], bootstrap_port, store, rng, page
            )
            for name, decode in decodes.items():
                cls.results[name] = dict(
                    info=decode.get("/server_info").json(),
                    runs=runs if name == "seed" else None,
                    oversized=pd_generate_both(
                        prefill, decode, bootstrap_port, oversized
                    ),
                    oversized_decode_first=pd_generate_both(
                        prefill, decode, bootstrap_port, oversized, decode_first=True
                    ),
                    # both servers still serve: a new prompt, answered in full
                    after=pd_generate(prefill, decode, bootstrap_port, "a new prompt"),
                    log=decode.log_text(),
                )
            cls.results["probe"] = probe_stall_capture(seed, bootstrap_port)
        except Exception as exc:
            logs = prefill.log_tail(3000)
            logs += "".join(
                d.log_tail(4000) for d in [*decodes.values(), *phased.values()]
            )
            raise RuntimeError(f"{exc}\n{logs}\n{STALLS.report()}") from exc
        finally:
            for sub in subs:
                sub.close()
            for server in (*decodes.values(), *phased.values(), prefill):
                pids += server.stop()
        assert_all_gone(pids)

    @staticmethod
    def stop_store(store):
        held = store.stop()["held_ports"]
        assert not held, f"the Mooncake store's ports still held: {held}"

    def test_decode_restores_a_prefix_only_in_l3_and_shares_it(self):
        l3 = self.results["l3"]
        print("l3:", {k: v for k, v in l3.items() if k != "store"})
        print("l3 store:", l3["store"])
        self.assertEqual(l3["attach"], {n: (200, l3["attach"][n][1]) for n in DECODES})
        first = l3["first"]
        self.assertEqual(first["cached"], 0, first)  # a new prompt
        # every full page of the served prompt reached the store
        self.assertGreaterEqual(l3["objects_written"], l3["full_pages"], l3)
        self.assertEqual(l3["flush"][0], 200, l3["flush"])
        # device and host flushed: every full page of the prompt restored
        # L3 -> L2 (two-phase prefetch) -> L1, counted as storage
        full = l3["full_pages"] * self.results["page"]
        revisit = l3["revisit"]
        self.assertEqual(revisit["details"].get("storage", 0), full, revisit)
        self.assertEqual(revisit["cached"], full, revisit)
        self.assertGreaterEqual(revisit["loaded_back"], full, revisit)
        self.assertEqual(revisit["output_ids"], first["output_ids"])
        # another decode instance on the store: a miss under a namespace
        # nothing stored has, then the seed worker's pages as storage hits;
        # the prefill server computes the same KV for both (one request at a
        # time), so the same greedy tokens
        miss, shared = l3["generic_miss"], l3["generic_shared"]
        self.assertEqual(miss["cached"], 0, miss)
        self.assertEqual(shared["details"].get("storage", 0), full, shared)
        self.assertEqual(shared["cached"], full, shared)
        self.assertEqual(shared["output_ids"], miss["output_ids"])

    def test_prefill_serves_a_next_turn_from_what_decode_put_in_l3(self):
        pl3, page = self.results["prefill_l3"], self.results["page"]
        print("prefill l3:", pl3)
        self.assertEqual(pl3["attach"][0], 200, pl3["attach"])
        first = pl3["first"]
        self.assertEqual(first["prefill"]["cached"], 0, first)  # a new prompt
        self.assertEqual(len(first["decode"]["output_ids"]), NEW_TOKENS, first)
        # the decode worker's tree keeps the prompt and every output token
        with_kv = pl3["prompt"] + NEW_TOKENS
        self.assertEqual(pl3["with_kv"], with_kv, pl3)
        # every page of them reached the store; prefill only ever computed
        # (and put) the prompt's
        stored = with_kv // page
        self.assertGreaterEqual(pl3["objects_written"], stored, pl3)
        self.assertEqual(pl3["flush"][0], 200, pl3["flush"])
        # prefill's device and host flushed: the second turn's prefix found
        # in the store, the first turn's output tokens included
        second = pl3["second"]["prefill"]
        self.assertEqual(second["details"].get("storage", 0), stored * page, second)
        self.assertEqual(second["cached"], stored * page, second)
        self.assertGreater(second["cached"], pl3["prompt"], second)
        # the same greedy tokens as the second turn computed whole, up to a
        # tie: that KV of the output tokens is the decode worker's, computed
        # one token at a time, the reference's prefill computes it in one
        # extend
        ref = pl3["reference"]
        self.assertEqual(ref["cached"], 0, ref)
        divergence = first_divergence(pl3["second"]["decode"], ref)
        self.assertIn((divergence or ("same",))[0], ("same", "tie"), (divergence, pl3))

    def test_a_rank_sharded_decode_worker_restores_its_shards_from_l3(self):
        sh, page = self.results["sharded"], self.results["page"]
        print("sharded:", {k: v for k, v in sh.items() if k not in ("pages",)})
        self.assertEqual(sh["attach"][0], 200, sh["attach"])
        # each rank's host pool and objects hold its layers: j % 2 == rank
        self.assertEqual(
            sorted(sh["owners"]),
            [
                (str(r), str(SHARD), str(list(range(r, LAYERS, SHARD))))
                for r in range(SHARD)
            ],
        )
        first, revisit = sh["first"], sh["revisit"]
        self.assertEqual(first["cached"], 0, first)  # not in its tree, nor in L3
        # every full page of the prompt: upstream's object (the seed worker's,
        # every layer) and one object per rank holding its two layers' rows
        # (64 + 32 latent values of bf16 per token and layer)
        row = (64 + 32) * 2
        shard_bytes = page * (LAYERS // SHARD) * row
        self.assertEqual(len(sh["pages"]), first["prompt"] // page, sh["pages"])
        for objects in sh["pages"]:
            # (shard rank, bytes) of each object; -1: upstream's unsharded one
            by_shard = sorted(
                (-1 if (r := mooncake_l3.shard_of(k)) is None else r, n)
                for k, n in objects.items()
            )
            expected = [(r, shard_bytes) for r in range(SHARD)]
            self.assertEqual(by_shard, [(-1, page * LAYERS * row), *expected], objects)
        # the write-through landed: each rank's written bytes = its objects'
        # growth, at least its shard of every full page (the fillers' come
        # after this)
        counters, shards = sh["settled"]["counters"], sh["settled"]["objects"]
        for r in range(SHARD):
            grown = sum(shards[r].values()) - sh["base"][r]
            self.assertEqual(counters.get((r, "written")), grown, (r, counters))
            self.assertGreaterEqual(grown, len(sh["pages"]) * shard_bytes, r)
        self.assertEqual(sh["flush"][0], 200, sh["flush"])
        for filler in sh["fillers"]:
            self.assertEqual(filler["cached"], 0, filler)
        # device and host flushed: every full page restored L3 -> L2 -> L1 on
        # both ranks, counted as storage, each rank reading only its shard
        full = len(sh["pages"]) * page
        self.assertEqual(revisit["details"].get("storage", 0), full, revisit)
        self.assertEqual(revisit["cached"], full, revisit)
        for r in range(SHARD):
            read = sh["read_after"].get((r, "read"), 0)
            read -= sh["read_before"].get((r, "read"), 0)
            self.assertEqual(read, len(sh["pages"]) * shard_bytes, r)
        # the restored rows are the ones it was sent (the slots they land in
        # held the fillers' KV): the same decode steps (one request at a
        # time) give the same tokens and logprobs
        self.assertEqual(revisit["output_ids"], first["output_ids"])
        self.assertEqual(revisit["top2"], first["top2"])
        # no vote found the ranks' radix trees, nor a load their host pages,
        # apart (either would also have failed its request)
        self.assertEqual(sh["diverged"], 0)

    def test_l3_faults_serve_log_one_line_each_and_recover(self):
        for part, phase in self.results["l3_faults"].items():
            lines = phase.pop("lines")
            print(f"l3 fault {part}:", phase, lines)
            # every request served in full while the part was away, and after
            for r in (*phase["down"], phase["back"], phase["after"]):
                self.assertNotIn("error", r, (part, r))
                self.assertEqual(len(r["output_ids"]), NEW_TOKENS, (part, r))
                self.assertLess(r["seconds"], 30, (part, r))
            # L3 resumed: every full page of the prompts after the recovery
            # reached the store
            for r in (phase["back"], phase["after"]):
                self.assertGreaterEqual(r["stored"], r["full"], (part, r))
            # one line when the part went away (the decode worker has one
            # rank), however many calls failed, and one when it came back
            self.assertEqual(len(lines), 2, (part, lines))
            self.assertIn(L3_DOWN_LINES[part], lines[0], part)
            self.assertIn(L3_BACK_LINE, lines[1], part)

    def test_a_stalled_request_is_captured(self):
        probe = self.results["probe"]
        # the probe never completed: the client cut it
        self.assertIsNone(probe["answer"], probe["answer"])
        self.assertEqual(len(probe["captures"]), 1, "one capture per stall")
        capture = probe["captures"][0]

        def check(text, why):  # the capture is long: name it, do not print it
            self.assertTrue(text in capture, f"{text!r} not in the capture: {why}")

        check("=== PD request stalled: probe, room", "its header")
        # every process of the three servers' trees, dumped by py-spy
        for name, pids in probe["pids"].items():
            self.assertGreater(len(pids), 1, name)
            for pid in pids:
                check(f"--- {name}: threads of pid {pid} ", name)
                check(f"Process {pid}: ", f"{name}: py-spy's dump")
            check(f"--- {name}: /v1/loads?include=disagg ---", name)
            check(f"--- {name}: transfer engine log (mooncake) ---", name)
        # the mooncake threads where they wait: prefill's bootstrap and
        # transfer threads, each decode rank's status thread (py-spy names a
        # thread by its target)
        for thread in ("bootstrap_thread", "transfer_worker", "decode_thread"):
            check(f'({thread})"', "a mooncake thread")
        check("MooncakeKVManager.transfer_worker (mooncake/conn.py:", "a frame")
        # the transfer engine's log and the disaggregation DEBUG lines
        check("tcp_transport.cpp", "mooncake's glog lines")
        check("CommonKVSender init with num_kv_indices", "a DEBUG line")

    def test_seed_flags_select_cache_aware_and_the_generic_ones_do_not(self):
        # 0.5.23 reads --dp-size N --enable-dp-attention as attn_dp_size N
        # (dp_size 1): N attention DP ranks behind one controller. The generic
        # worker has one rank: auto resolves to round_robin (the exception
        # that picks cache_aware needs more than one).
        expected = {
            "seed": ("cache_aware", True, "attn_dp_size", 2),
            "generic": ("round_robin", False, "dp_size", 1),
        }
        for name, (method, dp_attention, key, ranks) in expected.items():
            info = self.results[name]["info"]
            self.assertEqual(info.get("enable_dp_attention"), dp_attention, name)
            self.assertEqual(info.get(key), ranks, name)
            self.assertEqual(info.get("load_balance_method"), method, name)
            self.assertTrue(info.get("enable_hierarchical_cache"), name)
            self.assertFalse(info.get("disable_radix_cache"), name)

    def test_dp_attention_decode_with_the_decode_radix_cache(self):
        log = self.results["seed"]["log"]
        self.assertIn("'enable_dp_attention': True", log)
        # 0.5.23's warning that this setup needs prefix-aware routing
        self.assertIn("Decode radix cache with DP attention", log)
        self.assertNotIn("'enable_dp_attention': True", self.results["generic"]["log"])

    def test_the_scheduler_runs_the_seed_admission_from_the_seed_flag_only(self):
        # one line per DP rank's scheduler: two on the seed worker, none on
        # the generic one (one rank)
        for name, lines in (("seed", 2), ("generic", 0)):
            log = self.results[name]["log"]
            self.assertEqual(log.count(SEED_ADMISSION_LOG), lines, name)

    def _print(self, name):
        for key, run in self.results[name]["runs"].items():
            if "error" in run:
                print(f"{name} {key}: error {run['error']}")
                continue
            print(
                f"{name} {key}: rank {run['rank']} cached {run['cached']}/"
                f"{run['prompt']} {run['details']} loaded back {run['loaded_back']}"
            )

    def test_revisits_routed_to_their_holder_and_restored_from_host(self):
        self._print("seed")
        runs = self.results["seed"]["runs"]
        order = [name for name, _ in workload()]
        self.assertEqual(runs["A"]["cached"], 0)  # no prefill-side cache
        self.assertEqual(runs["B"]["cached"], 0)
        self.assertNotEqual(runs["A"]["rank"], runs["B"]["rank"])
        for key in ("A", "B"):
            again = runs[f"{key} again"]
            # round_robin would send the revisit to the other rank
            self.assertNotEqual(order.index(f"{key} again") % 2, order.index(key) % 2)
            self.assertEqual(again["rank"], runs[key]["rank"], key)
            # the whole prompt but its last token, restored from the host tier
            self.assertGreaterEqual(again["cached"], again["prompt"] - 1, key)
            self.assertGreaterEqual(again["loaded_back"], again["prompt"] - 1, key)
            # ... and reported as host hits (fixes/0008; 0.5.23 reports them
            # as device hits): the tokens loaded back, the rest device hits
            details = again["details"]
            host, device = details.get("host", 0), details.get("device", 0)
            self.assertEqual(host, again["loaded_back"], key)
            self.assertEqual(device + host, again["cached"], key)
            self.assertEqual(again["output_ids"], runs[key]["output_ids"], key)

    def test_kv_events_report_the_decode_host_tier_per_rank(self):
        # Each DP rank's publisher reports its own tree's moves (attn_dp_rank
        # = the rank), no transition twice, and a block stored on the GPU again
        # after its host copy and its eviction from the GPU for every token a
        # revisit loaded back from that rank's host tier, plus the revisit's
        # NEW_TOKENS outputs: the first visit's greedy tokens again (checked
        # above), whose host-only blocks its decode puts back on the GPU.
        runs, page = self.results["seed"]["runs"], self.results["page"]
        for rank, records in enumerate(self.results["events"]):
            self.assertEqual({r[1] for r in records}, {rank})
            history, _, _ = blocks(records, page)
            self.assertEqual(alternation_errors(history), [], rank)
            load_back = [(STORED, CPU), (REMOVED, GPU), (STORED, GPU)]
            reloaded = [h for h, ev in history.items() if ev[-3:] == load_back]
            revisits = [
                run
                for run in runs.values()
                if run["rank"] == rank and run.get("loaded_back")
            ]
            loaded = sum(run["loaded_back"] for run in revisits)
            print(f"rank {rank}: {len(history)} blocks, {len(reloaded)} back on GPU")
            self.assertEqual(len(revisits), 1, rank)  # A's or B's
            self.assertEqual(
                len(reloaded) * page, loaded + NEW_TOKENS * len(revisits), rank
            )

    def test_control_misses_the_revisits_where_round_robin_routes_them(self):
        seed = self.results["seed"]["runs"]
        self._print("round_robin")
        runs = self.results["round_robin"]["runs"]
        order = [key for key, _ in workload()]
        for i, key in enumerate(order):
            # served on the rank it was sent to (a decode worker ignoring
            # routed_dp_rank would route it by cache: the revisits hit)
            self.assertEqual(runs[key]["rank"], i % 2, key)
            # the seed worker's geometry: the same greedy outputs as its
            # run's, hit or miss
            self.assertEqual(runs[key]["output_ids"], seed[key]["output_ids"], key)
        for key in ("A", "B"):
            again = runs[f"{key} again"]
            self.assertNotEqual(again["rank"], runs[key]["rank"], key)
            self.assertEqual(again["cached"], 0, key)
            self.assertEqual(again["loaded_back"], 0, key)

    def test_the_control_counts_as_routed_by_the_client(self):
        # every control request named its rank: outcome external, each once
        self.assertEqual(
            self.results["round_robin"]["outcomes"], {"external": len(workload())}
        )

    def test_a_burst_before_its_decode_landing_is_routed_by_load(self):
        burst = self.results["burst"]
        print("burst:", [(m.get("dp_rank"), m["cached_tokens"]) for m in burst["meta"]])
        # neither could reuse the other's transferred KV: two misses (credit
        # from dispatch routed the second by its match to the first's rank)
        self.assertEqual(burst["outcomes"], {"miss": 2}, burst)
        self.assertEqual({m["dp_rank"] for m in burst["meta"]}, {0, 1}, burst)

    def test_a_request_no_decode_pool_can_admit_is_refused_and_prefill_freed(self):
        for name in DECODES:
            for case in ("oversized", "oversized_decode_first"):
                both = self.results[name][case]
                print(name, case, both)
                # 0.5.23 answers neither: the decode worker keeps the request
                # queued and prefill waits for its bootstrap timeout (300 s).
                status, text, _ = both["decode"]
                self.assertEqual(status, 400, (name, case, text))
                self.assertIn("can never be admitted by this decode worker", text)
                self.assertIn(f"decode KV pool's {DECODE_POOL}", text)
                # prefill was told through the KV receiver's abort and let it
                # go within seconds, whether the abort came after the request
                # or before it (fixes/0013; 0.5.23 drops that abort): it
                # answers, and its bootstrap queue is empty. Which of the two
                # a dropped abort breaks first is a race (a peer's failure can
                # fail the request at once, its sender still queued), so both
                # name the claim.
                status, text, seconds = both["prefill"]
                self.assertLess(seconds, PREFILL_FREED_S, (NOT_FREED, name, case, text))
                self.assertIsNotNone(status, (name, case))
                self.assertNotEqual(status, 200, (name, case, text))
                self.assertEqual(both["bootstrapping"], 0, (NOT_FREED, name, case))
            after = self.results[name]["after"]
            self.assertNotIn("error", after, name)
            self.assertGreater(len(after["output_ids"]), 0, name)


if __name__ == "__main__":
    unittest.main()
