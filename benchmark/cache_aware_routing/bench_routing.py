"""Trace-driven simulation of DP routing policies over real radix trees.

Every DP rank owns a real ``UnifiedRadixCache`` (Rust tree core, CPU KV pool)
with a real HiCache host tier (write-back; CPU stand-ins for pinned memory and
the two direct copy ops), sized so that both tiers evict. Seeded generators
produce two workloads:

* ``multiturn``: conversations whose every turn resends the whole history plus
  a new user message (the previous answer is cached with the turn);
* ``sysprompt``: requests sharing one of a few long system prompts, each with a
  unique question;
* ``shortchat``: conversations of short turns (40-200 token first messages,
  10-60 token follow-ups): many prompts shorter than a 256-token chunk.

For each DP size and workload the same trace is routed by every policy, side
by side in one run:

* ``round_robin``, ``total_requests``, ``total_tokens``: upstream's methods;
* ``cache_aware``: ours (``CacheAwareRouter`` fed by ``PrefixDigestTracker``
  digests published every 100 ms of simulated time, encoded and decoded as on
  the wire, with the server defaults: chunk size (``--chunk-sizes N ...`` adds
  ``cache_aware_cN``, the same with ``--dp-routing-digest-chunk-size N``;
  ``dig B`` and ``KiB/s``: its digests' bytes per publish and per simulated
  second over all ranks), ``--dp-routing-max-extra-reqs``,
  ``--dp-routing-pending-ttl``; a request's prefix earns credit once its rank
  reports its prefill landed, at the modeled end of its prefill, as a wire
  ``PrefillLanded``); ``cache_aware_ttl0`` the same without pending
  prefixes. The router runs in a controller process of its own (as the
  DataParallelController is), on a CPU of its own where the machine has two
  or more; requests reach it pickled and digests as wire payloads. Its
  controller time counts digest decoding and routing, not unpickling the
  request (every policy's controller pays that) nor the ranks' digest
  building. ``--controller inline`` runs it in the simulation's process
  instead, between the ranks' tree work, as the other policies run;
* ``smg``: SGLang Model Gateway's ``cache_aware`` policy with its Python
  RouterArgs defaults (cache_threshold 0.3, balance_abs_threshold 64,
  balance_rel_threshold 1.5): a per-worker approximate tree of what it routed
  there (tokens instead of characters), never told about evictions;
* ``dynamo``: Dynamo's KV-router cost (docs/components/router/router-concepts):
  ``cost = adjusted_prefill + active_decode`` with
  ``adjusted_prefill = max(active_prefill + prompt - overlap, 0)`` in blocks
  (``active_prefill``: prefill work still queued on the rank; ``active_decode``:
  KV blocks of its requests in flight), overlap from an exact per-block index
  of the KV events, host blocks weighted 0.75, temperature 0.

Served requests: the rank matches its tree (GPU and host hits), computes the
rest, and inserts prompt plus answer. Each rank is a FIFO server; the modeled
time to first token is queueing plus ``uncached / PREFILL_TPS + host_hit /
LOAD_TPS + OVERHEAD_S``. Load seen by the policies is the rank's requests and
tokens still in service at the arrival time. Reported per policy: GPU and host
prefix hit rate, prefill tokens computed, load imbalance (max/mean busy time),
mean and p90 modeled TTFT, controller time per request (``ctl us``: in the
run, paced by the arrivals; ``b2b``: the run's stream of digests and requests
routed again back to back in a fresh router in the controller process, the
median of 5 replays that must repeat every decision, the digests taken in at
the run's ratio of digests to requests; ``route``: the same replay without
taking in the digests, landings and decisions only, what every request
costs; ``/dig``: the digests' part per digest. The digests arrive at their own
rate, at most one per rank per publish interval, whatever the request rate:
with requests queued at the controller one costs ``route`` plus ``/dig`` times
digests per request, which bounds its throughput); ratios are against
``round_robin`` of the same run. Per workload also the *read floor*: the mean
time to read a request's tokens once into a u32 array (a fresh copy of the
prompt, as the controller unpickles it), the least any policy that hashes the
prompt in Python pays.

Run: ``python -m benchmark.cache_aware_routing.bench_routing [--quick]`` with
the patched sglang importable (PYTHONPATH) and ``tests`` on the path.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import random
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from benchmark.bench_meta import run_dir, run_metadata

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


PAGE = 16
PREFILL_TPS = 20000.0  # prefill tokens per second per rank
LOAD_TPS = 200000.0  # host-to-device load-back, tokens per second
OVERHEAD_S = 0.005
DECODE_S = 0.3  # a request stays "running" (load) this long after prefill
PUBLISH_S = 0.1
REPLAYS = 5  # back-to-back replays of cache_aware's stream (median reported)


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------


@dataclass
class Request:
    rid: int
    arrival: float
    prompt: list
    answer: list


def _tokens(rng, n):
    return [rng.randrange(1, 32000) for _ in range(n)]


def multiturn(rng, n_req, n_conv):
    convs = [
        {"hist": _tokens(rng, rng.randrange(200, 800)), "turns": 0}
        for _ in range(n_conv)
    ]
    out = []
    active = list(range(n_conv))
    for i in range(n_req):
        c = convs[rng.choice(active)]
        prompt = c["hist"] + _tokens(rng, rng.randrange(30, 200))
        answer = _tokens(rng, rng.randrange(50, 300))
        c["hist"] = prompt + answer
        c["turns"] += 1
        out.append(Request(i, 0.0, prompt, answer))
        if c["turns"] > 12:  # finished: replace by a new conversation
            c["hist"], c["turns"] = _tokens(rng, rng.randrange(200, 800)), 0
    return out


def shortchat(rng, n_req, n_conv):
    """Chat whose turns stay short: a 40-200 token first message, 10-60
    token follow-ups, 20-120 token answers; a conversation ends after 8
    turns (most prompts are under 1000 tokens, many under 256)."""
    new_conv = lambda: {
        "hist": _tokens(rng, rng.randrange(40, 200)),
        "turns": 0,
    }  # noqa: E731
    convs = [new_conv() for _ in range(n_conv)]
    out = []
    for i in range(n_req):
        k = rng.randrange(n_conv)
        c = convs[k]
        prompt = c["hist"] + (_tokens(rng, rng.randrange(10, 60)) if c["turns"] else [])
        answer = _tokens(rng, rng.randrange(20, 120))
        c["hist"] = prompt + answer
        c["turns"] += 1
        out.append(Request(i, 0.0, prompt, answer))
        if c["turns"] >= 8:
            convs[k] = new_conv()
    return out


WORKLOADS = ("multiturn", "sysprompt", "shortchat")


def sysprompt(rng, n_req, n_prompts):
    prompts = [_tokens(rng, rng.randrange(1000, 3000)) for _ in range(n_prompts)]
    weights = [1.0 / (k + 1) for k in range(n_prompts)]  # Zipf-like popularity
    out = []
    for i in range(n_req):
        p = rng.choices(prompts, weights)[0]
        out.append(
            Request(i, 0.0, p + _tokens(rng, rng.randrange(20, 200)), _tokens(rng, 64))
        )
    return out


def with_arrivals(rng, reqs, dp, utilization):
    mean_service = sum(len(r.prompt) for r in reqs) / len(reqs) / PREFILL_TPS
    rate = utilization * dp / (mean_service + OVERHEAD_S)
    t = 0.0
    for r in reqs:
        t += rng.expovariate(rate)
        r.arrival = t
    return reqs


# ---------------------------------------------------------------------------
# Ranks: real trees
# ---------------------------------------------------------------------------


class Rank:
    def __init__(self, kv_tokens, host_ratio):
        from harness.stacks.radix_tree_fixtures import build_tree, enable_hicache

        self.kv_tokens = kv_tokens
        self.tree = build_tree(PAGE, "rust", kv_size=kv_tokens)
        enable_hicache(self.tree, hicache_size=0, hicache_ratio=host_ratio)
        self.tree.cache.take_events()
        self.free_at = 0.0
        self.busy = 0.0
        self.inflight = []  # (finish_time, tokens)

    def load(self, now):
        self.inflight = [(f, n) for f, n in self.inflight if f > now]
        return len(self.inflight), sum(n for _, n in self.inflight)

    def serve(self, req, now):
        from harness.stacks.radix_tree_fixtures import insert, match

        m = match(self.tree, req.prompt)
        gpu = m.device_prefix_len
        host = m.host_hit_length
        uncached = len(req.prompt) - gpu - host
        insert(self.tree, req.prompt + req.answer)
        service = uncached / PREFILL_TPS + host / LOAD_TPS + OVERHEAD_S
        start = max(now, self.free_at)
        self.free_at = start + service
        self.busy += service
        self.inflight.append((self.free_at + DECODE_S, len(req.prompt)))
        return gpu, host, uncached, self.free_at - now


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------


class Budget:
    """DPBudget's fields, refreshed from the ranks' loads at every arrival."""

    def __init__(self, dp):
        self.total_requests = [0] * dp
        self.total_tokens = [0] * dp
        self.last_timestamp = [0.0] * dp  # every rank's load is fresh


class Policy:
    name = ""
    # Policies that time their own controller work (``controller_s``) set
    # this; the others are timed around ``choose``.
    self_timed = False
    controller_s = 0.0

    def __init__(self, ranks):
        self.ranks = ranks
        self.dp = len(ranks)
        self.budget = Budget(self.dp)

    def refresh(self, now):
        for i, r in enumerate(self.ranks):
            self.budget.total_requests[i], self.budget.total_tokens[i] = r.load(now)
            self.budget.last_timestamp[i] = now

    def on_events(self, rank, events, now):
        pass

    def on_served(self, rank, req, prefill_done):
        """``req`` (routed to ``rank``) finishes its prefill at
        ``prefill_done``."""

    def choose(self, req, now):
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, ranks):
        super().__init__(ranks)
        self.i = 0

    def choose(self, req, now):
        self.i += 1
        return (self.i - 1) % self.dp


class TotalRequests(Policy):
    name = "total_requests"

    def choose(self, req, now):
        reqs = self.budget.total_requests
        return reqs.index(min(reqs))


class TotalTokens(Policy):
    name = "total_tokens"

    def choose(self, req, now):
        b = self.budget
        return min(
            range(self.dp), key=lambda i: (b.total_tokens[i], b.total_requests[i])
        )


class Ours(Policy):
    name = "cache_aware"
    pending_ttl = 2.0  # the server default (--dp-routing-pending-ttl)
    self_timed = True
    # Where the router runs: "process" (a controller process of its own, as
    # the DataParallelController is) or "inline" (in the simulation's process).
    controller = "process"

    chunk = None  # None: the server's default (rounded up to PAGE)

    def __init__(self, ranks, max_extra=16):
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        super().__init__(ranks)
        chunk = self.chunk or default_chunk()
        self.now = 0.0
        args = (self.dp, max_extra, self.pending_ttl)
        if self.controller == "process":
            self.router = _ControllerProcess(*args)
        else:
            self.router = _InlineController(*args)
        self.trackers = [PrefixDigestTracker(PAGE, chunk) for _ in ranks]
        self.chunk = chunk
        self.digest_bytes = 0  # every payload the ranks published
        self.publishes = 0
        self.seq = [0] * self.dp
        self.last_publish = -1.0
        self.landings = []  # heap of (prefill done, rank, rid, prompt tokens)

    def on_events(self, rank, events, now):
        self.trackers[rank].apply(events)

    def on_served(self, rank, req, prefill_done):
        heapq.heappush(
            self.landings, (prefill_done, rank, str(req.rid), len(req.prompt))
        )

    def _landed(self, now):
        """The wire ``PrefillLanded`` of every prefill done by ``now``."""
        from sglang.srt.managers.dp_routing.landing import PrefillLanded

        out = []
        while self.landings and self.landings[0][0] <= now:
            _, rank, rid, upto = heapq.heappop(self.landings)
            out.append(PrefillLanded(dp_rank=rank, rids=[rid], upto=[upto]).encode())
        return out

    def choose(self, req, now):
        from sglang.srt.managers.dp_routing.digest import CacheDigest

        self.now = now
        payloads = []
        if now - self.last_publish >= PUBLISH_S:
            self.last_publish = now
            for i, (rank, tracker) in enumerate(zip(self.ranks, self.trackers)):
                gpu, host = tracker.build()  # the rank's side: build and encode
                self.seq[i] += 1
                payloads.append(
                    CacheDigest(
                        dp_rank=i,
                        epoch=1,
                        seq=self.seq[i],
                        page_size=PAGE,
                        chunk_size=self.chunk,
                        timestamp=now,
                        available_tokens=rank.tree.allocator.available_size()
                        + rank.tree.cache.evictable_size(),
                        capacity_tokens=rank.kv_tokens,
                        gpu_hashes=gpu,
                        host_hashes=host,
                    ).encode()
                )
                self.digest_bytes += len(payloads[-1])
                self.publishes += 1
        landed = self._landed(now)
        rank, spent = self.router.route(
            now, payloads, landed, req.prompt, str(req.rid), self.budget
        )
        self.controller_s += spent
        return rank

    def replay_s(self, repeats=REPLAYS):
        """``(seconds, digest seconds)`` to route the same stream again back
        to back in a fresh router (in the controller process), the replay of
        median seconds among ``repeats``; the decisions must repeat. The
        digest seconds are the part spent taking in the ranks' digests."""
        times = []
        for _ in range(repeats):
            spent, digest_s, ranks = self.router.replay()
            if ranks != self.router.ranks:
                raise RuntimeError(f"{self.name}: the replay routed differently")
            times.append((spent, digest_s))
        return sorted(times)[len(times) // 2]

    def close(self):
        self.router.close()


class _InlineController:
    """The router in the calling process. ``route`` returns the chosen rank
    and the seconds spent decoding digests and routing; every call is logged
    so that ``replay`` can route the same stream again in a fresh router."""

    def __init__(self, dp, max_extra, pending_ttl):
        from sglang.srt.managers.dp_routing.router import CacheAwareRouter

        self.args = (dp, max_extra, pending_ttl)
        self.dp = dp
        self.now = 0.0
        self.router = CacheAwareRouter(
            dp,
            max_extra_reqs=max_extra,
            digest_max_age=5.0,
            pending_ttl=pending_ttl,
            clock=lambda: self.now,
            credit_on_landing=True,
        )
        self.budget = Budget(dp)
        self.log, self.ranks = [], []

    def route(self, now, payloads, landed, prompt, rid, budget):
        body = (now, payloads, landed, prompt, rid)
        body += (budget.total_requests, budget.total_tokens)
        self.log.append(body[:5] + (list(body[5]), list(body[6])))
        rank, spent, _ = self._route(body)
        self.ranks.append(rank)
        return rank, spent

    def _route(self, body):
        """Route one logged call (the controller process and replays call
        this directly: they keep no log): ``(rank, seconds, seconds of
        them taking in the digests)``."""
        from sglang.srt.managers.dp_routing.digest import CacheDigest
        from sglang.srt.managers.dp_routing.landing import PrefillLanded
        from sglang.srt.managers.dp_routing.request import RoutedRequest

        self.now, payloads, landed, prompt, rid, requests, tokens = body
        self.budget.total_requests[:] = requests
        self.budget.total_tokens[:] = tokens
        t0 = time.perf_counter()
        for payload in payloads:
            self.router.update_digest(CacheDigest.decode(payload))
        t_digests = time.perf_counter()
        for payload in landed:
            self.router.on_landed(PrefillLanded.decode(payload))
        request = RoutedRequest(prompt, rid=rid)  # a list, as in the server
        rank = self.router.select(request, self.budget, range(self.dp)).rank
        return rank, time.perf_counter() - t0, t_digests - t0

    def replay(self):
        """``(seconds, digest seconds, ranks)`` of routing the logged stream
        again, back to back, in a fresh router (prompts as fresh copies)."""
        import pickle

        return _replay(self.args, pickle.loads(pickle.dumps(self.log)))

    def close(self):
        pass


def _replay(args, bodies):
    fresh = _InlineController(*args)
    total, digests, ranks = 0.0, 0.0, []
    for body in bodies:
        rank, spent, digest_s = fresh._route(body)
        total += spent
        digests += digest_s
        ranks.append(rank)
    return total, digests, ranks


def _controller_main(conn, args, cpu):
    import gc
    import pickle

    # The fork's copy of the simulation (traces, trees) is not the
    # controller's heap: keep the garbage collector from scanning it.
    gc.freeze()
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    inline = _InlineController(*args)
    while True:
        msg = conn.recv_bytes()
        if not msg:
            break
        kind, body = pickle.loads(msg)
        conn.send(inline._route(body)[:2] if kind == "route" else _replay(args, body))


class _ControllerProcess:
    """The router in a process of its own, as in the server: the prompt
    arrives pickled (the controller unpickles a request before routing it,
    whatever the policy, so that is not counted), digests arrive as wire
    payloads. Where the machine has two or more CPUs the controller gets one
    to itself and the simulation (the ranks' trees) the others, as a
    controller process does not share its core with the schedulers' work."""

    def __init__(self, dp, max_extra, pending_ttl):
        import multiprocessing

        cpus = sorted(os.sched_getaffinity(0))
        self.cpus = cpus
        cpu = cpus[-1] if len(cpus) > 1 else None
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_controller_main,
            args=(child, (dp, max_extra, pending_ttl), cpu),
            daemon=True,
        )
        self.proc.start()
        if cpu is not None:
            os.sched_setaffinity(0, set(cpus[:-1]))
        self.log, self.ranks = [], []

    def _call(self, kind, body):
        import pickle

        self.conn.send_bytes(pickle.dumps((kind, body)))
        return self.conn.recv()

    def route(self, now, payloads, landed, prompt, rid, budget):
        body = (
            now,
            payloads,
            landed,
            prompt,
            rid,
            list(budget.total_requests),
            list(budget.total_tokens),
        )
        self.log.append(body)
        rank, spent = self._call("route", body)
        self.ranks.append(rank)
        return rank, spent

    def replay(self):
        return self._call("replay", self.log)

    def close(self):
        self.conn.send_bytes(b"")
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
        os.sched_setaffinity(0, set(self.cpus))


class OursNoPending(Ours):
    name = "cache_aware_ttl0"
    pending_ttl = 0.0


def default_chunk() -> int:
    """The server's default digest chunk in tokens, rounded up to PAGE."""
    from sglang.srt.arg_groups.cache_aware_routing_hook import (
        DEFAULT_DIGEST_CHUNK_TOKENS,
    )

    return -(-DEFAULT_DIGEST_CHUNK_TOKENS // PAGE) * PAGE


def with_chunk(size: int):
    """``cache_aware`` with ``--dp-routing-digest-chunk-size size``."""
    return type(
        f"OursC{size}", (Ours,), {"name": f"cache_aware_c{size}", "chunk": size}
    )


def _page_keys(tokens):
    """Chained page keys (SMG keeps characters in a radix tree; a chain of page
    digests gives the same longest-prefix answer for token sequences)."""
    keys, h = [], b""
    for i in range(0, len(tokens) // PAGE * PAGE, PAGE):
        h = hashlib.blake2b(
            h + array("I", tokens[i : i + PAGE]).tobytes(), digest_size=8
        ).digest()
        keys.append(h)
    return keys


class SMG(Policy):
    """SMG cache_aware (Python RouterArgs defaults)."""

    name = "smg"
    cache_threshold = 0.3
    balance_abs = 64
    balance_rel = 1.5
    max_tree_size = 2**26  # pages here; effectively never evicted

    def __init__(self, ranks):
        super().__init__(ranks)
        self.trees = [dict() for _ in ranks]

    def choose(self, req, now):
        loads = self.budget.total_requests
        lo, hi = min(loads), max(loads)
        keys = _page_keys(req.prompt)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            target = loads.index(lo)
        else:
            best, best_len = 0, -1
            for i, t in enumerate(self.trees):
                n = 0
                for k in keys:
                    if k not in t:
                        break
                    n += 1
                if n > best_len:
                    best, best_len = i, n
            rate = best_len / len(keys) if keys else 0.0
            target = best if rate > self.cache_threshold else loads.index(lo)
        tree = self.trees[target]
        for k in keys:
            tree[k] = now
        if len(tree) > self.max_tree_size:
            for k, _ in sorted(tree.items(), key=lambda kv: kv[1])[
                : len(tree) - self.max_tree_size
            ]:
                del tree[k]
        return target


class Dynamo(Policy):
    """Dynamo KV-router cost with an exact per-block index from KV events."""

    name = "dynamo"
    host_weight = 0.75

    def __init__(self, ranks):
        from sglang.srt.managers.dp_routing.tracker import PrefixDigestTracker

        super().__init__(ranks)
        self.trackers = [PrefixDigestTracker(PAGE, PAGE) for _ in ranks]
        self.sets = [None] * len(ranks)

    def on_events(self, rank, events, now):
        self.trackers[rank].apply(events)

    def _block_sets(self, i):
        """Rank ``i``'s (GPU, host) block keys, unpacked again only when
        its tracker rebuilt them."""
        from sglang.srt.managers.dp_routing.digest import unpack_hashes

        built = self.trackers[i].build()
        if self.sets[i] is None or self.sets[i][0] is not built:
            self.sets[i] = (built, unpack_hashes(built[0]), unpack_hashes(built[1]))
        return self.sets[i][1:]

    def choose(self, req, now):
        from sglang.srt.managers.dp_routing.chunk_keys import (
            RequestChunks,
            RequestNamespace,
        )

        from harness.dp_routing_fixtures import estimate_prefix_match

        chunks = RequestChunks(req.prompt, PAGE, PAGE, RequestNamespace())
        blocks = len(req.prompt) / PAGE
        best, best_cost = 0, None
        for i in range(self.dp):
            m = estimate_prefix_match(chunks, *self._block_sets(i))
            overlap = (m.gpu_len + self.host_weight * m.host_len) / PAGE
            # Prefill work still queued on the rank, and KV blocks of its
            # running requests, both in blocks.
            active_prefill = max(self.ranks[i].free_at - now, 0.0) * PREFILL_TPS / PAGE
            active_decode = self.budget.total_tokens[i] / PAGE
            adjusted = max(active_prefill + blocks - overlap, 0.0)
            cost = adjusted + active_decode
            if best_cost is None or cost < best_cost:
                best, best_cost = i, cost
        return best


POLICIES = [RoundRobin, TotalRequests, TotalTokens, Ours, OursNoPending, SMG, Dynamo]


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------


@dataclass
class Result:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    gpu_hit: int = 0
    host_hit: int = 0
    computed: int = 0
    ttft: list = field(default_factory=list)
    busy: list = field(default_factory=list)
    controller_s: float = 0.0
    replay_s: float = float("nan")
    # The part of replay_s spent taking in the digests.
    replay_digest_s: float = float("nan")
    evicted: int = 0
    digest_bytes: int = 0
    publishes: int = 0
    sim_s: float = 0.0

    def summary(self):
        t = sorted(self.ttft)
        mean_busy = sum(self.busy) / len(self.busy)
        return {
            "policy": self.policy,
            "requests": self.requests,
            "gpu_hit_rate": self.gpu_hit / self.prompt_tokens,
            "host_hit_rate": self.host_hit / self.prompt_tokens,
            "prefill_tokens": self.computed,
            "imbalance": max(self.busy) / mean_busy if mean_busy else 1.0,
            "ttft_mean_s": sum(t) / len(t),
            "ttft_p90_s": t[int(0.9 * (len(t) - 1))],
            "controller_us_per_req": 1e6 * self.controller_s / self.requests,
            "controller_back_to_back_us_per_req": 1e6 * self.replay_s / self.requests,
            # The same without taking in the digests (landings and the
            # decision: what every request costs), and the digests' part per
            # digest: at saturation a request costs the first, the digests
            # arrive at their own rate (at most one per rank per publish
            # interval).
            "controller_back_to_back_route_us_per_req": (
                1e6 * (self.replay_s - self.replay_digest_s) / self.requests
            ),
            "controller_back_to_back_us_per_digest": (
                1e6 * self.replay_digest_s / self.publishes
                if self.publishes
                else float("nan")
            ),
            "gpu_evicted_tokens": self.evicted,
            # cache_aware only: the ranks' digests, per publish and per
            # simulated second over all ranks
            "digest_bytes_per_publish": (
                self.digest_bytes / self.publishes if self.publishes else None
            ),
            "digest_kib_per_s": (
                self.digest_bytes / 1024 / self.sim_s if self.publishes else None
            ),
        }


def simulate(policy_cls, trace, dp, kv_tokens, host_ratio, decisions=None):
    """The policy's summary row; ``decisions`` (a list) gets the chosen rank
    of every request."""
    ranks = [Rank(kv_tokens, host_ratio) for _ in range(dp)]
    policy = policy_cls(ranks)
    res = Result(policy.name)
    for req in trace:
        now = req.arrival
        policy.refresh(now)
        before = policy.controller_s
        t0 = time.perf_counter()
        rank = policy.choose(req, now)
        elapsed = time.perf_counter() - t0
        if decisions is not None:
            decisions.append(rank)
        res.controller_s += (
            policy.controller_s - before if policy.self_timed else elapsed
        )
        gpu, host, uncached, ttft = ranks[rank].serve(req, now)
        policy.on_served(rank, req, now + ttft)
        events = ranks[rank].tree.cache.take_events()
        res.evicted += PAGE * sum(
            len(e.block_hashes)
            for e in events
            if type(e).__name__ == "BlockRemoved" and e.medium == "GPU"
        )
        policy.on_events(rank, events, now)
        res.requests += 1
        res.prompt_tokens += len(req.prompt)
        res.gpu_hit += gpu
        res.host_hit += host
        res.computed += uncached
        res.ttft.append(ttft)
    res.busy = [r.busy for r in ranks]
    res.digest_bytes = getattr(policy, "digest_bytes", 0)
    res.publishes = getattr(policy, "publishes", 0)
    res.sim_s = trace[-1].arrival - trace[0].arrival if len(trace) > 1 else 0.0
    if hasattr(policy, "replay_s"):
        res.replay_s, res.replay_digest_s = policy.replay_s()
        policy.close()
    for r in ranks:
        r.tree.cache.release_host_resources()
    return res.summary()


# Summary fields that depend on the decisions only (not on timing).
_EXACT_KEYS = (
    "requests",
    "gpu_hit_rate",
    "host_hit_rate",
    "prefill_tokens",
    "imbalance",
    "ttft_mean_s",
    "gpu_evicted_tokens",
)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CI smoke run")
    ap.add_argument("--dp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--utilization", type=float, default=0.7)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument(
        "--controller",
        choices=("process", "inline"),
        default="process",
        help="where cache_aware's router runs (see the module docstring)",
    )
    ap.add_argument(
        "--kv-tokens", type=int, default=None, help="device KV tokens per rank"
    )
    ap.add_argument(
        "--decisions",
        default=None,
        metavar="PATH",
        help="also write every policy's chosen rank per request and its hit "
        "counts to PATH (JSON), to compare two revisions' decisions exactly",
    )
    ap.add_argument(
        "--chunk-sizes",
        type=int,
        nargs="+",
        default=[],
        help="also run cache_aware with these --dp-routing-digest-chunk-size "
        "values (multiples of the page size, 16), as cache_aware_cN",
    )
    ap.add_argument(
        "--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS
    )
    ap.add_argument(
        "--policies",
        nargs="+",
        default=None,
        help="run only these policies (names as in the table; round_robin always)",
    )
    args = ap.parse_args()
    Ours.controller = args.controller
    policies = POLICIES + [with_chunk(c) for c in args.chunk_sizes]
    if args.policies:
        policies = [
            c for c in policies if c is RoundRobin or c.name in set(args.policies)
        ]

    n_req = 300 if args.quick else 2000
    kv_tokens = args.kv_tokens or (4096 if args.quick else 8192)
    host_ratio = 2.0
    runs, decisions = [], {}
    for dp in args.dp:
        for workload in args.workloads:
            rng = random.Random(args.seed * 1000 + dp)
            if workload == "multiturn":
                trace = multiturn(rng, n_req, n_conv=12 * dp)
            elif workload == "shortchat":
                trace = shortchat(rng, n_req, n_conv=12 * dp)
            else:
                trace = sysprompt(rng, n_req, n_prompts=6 * dp)
            trace = with_arrivals(rng, trace, dp, args.utilization)
            rows = []
            for cls in policies:
                t0 = time.perf_counter()
                landed = []
                row = simulate(cls, trace, dp, kv_tokens, host_ratio, landed)
                row["wall_s"] = time.perf_counter() - t0
                decisions[f"dp{dp}/{workload}/{row['policy']}"] = {
                    "ranks": landed,
                    **{k: row[k] for k in _EXACT_KEYS},
                }
                rows.append(row)
            base = rows[0]
            for row in rows:
                for k in ("prefill_tokens", "ttft_mean_s", "ttft_p90_s"):
                    row[k + "_vs_rr"] = row[k] / base[k] if base[k] else float("nan")
            floor_us = read_floor_us(trace)
            runs.append(
                {
                    "dp": dp,
                    "workload": workload,
                    "read_floor_us_per_req": floor_us,
                    "rows": rows,
                }
            )
            _print(dp, workload, rows, floor_us)

    if args.decisions:
        Path(args.decisions).write_text(json.dumps(decisions, indent=1))
    os.makedirs(args.out, exist_ok=True)
    meta = {
        **run_metadata(),
        "params": {
            "page_size": PAGE,
            "requests": n_req,
            "kv_tokens_per_rank": kv_tokens,
            "host_ratio": host_ratio,
            "prefill_tps": PREFILL_TPS,
            "load_tps": LOAD_TPS,
            "utilization_target": args.utilization,
            "seed": args.seed,
            "controller": args.controller,
            "default_chunk": default_chunk(),
            "chunk_sizes": args.chunk_sizes,
            "workloads": args.workloads,
        },
        "runs": runs,
    }
    path = (
        run_dir(args.out, "routing" + ("-quick" if args.quick else ""))
        / "bench_routing.json"
    )
    path.write_text(json.dumps(meta, indent=2))
    png = path.with_suffix(".png")
    _plot(runs, png)
    shown = [p.relative_to(ROOT) if p.is_relative_to(ROOT) else p for p in (path, png)]
    print(f"\nwrote {shown[0]} and {shown[1]}")


def read_floor_us(trace) -> float:
    """Mean microseconds to read a fresh copy of each prompt into array("I")."""
    import pickle

    total = 0.0
    for req in trace:
        fresh = pickle.loads(pickle.dumps(req.prompt))
        t0 = time.perf_counter()
        array("I", fresh)
        total += time.perf_counter() - t0
    return 1e6 * total / len(trace)


def _print(dp, workload, rows, floor_us):
    print(f"\nDP={dp} workload={workload} (read floor {floor_us:.0f} us/req)")
    head = (
        f"{'policy':<15}{'gpu hit':>8}{'host hit':>9}{'prefill tok':>12}{'vs rr':>7}"
        f"{'imbal':>7}{'ttft mean':>10}{'vs rr':>7}{'ttft p90':>9}{'vs rr':>7}{'ctl us':>8}"
        f"{'b2b':>6}{'route':>6}{'/dig':>6}{'evicted':>9}{'dig B':>8}{'KiB/s':>7}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['policy']:<15}{r['gpu_hit_rate']:>8.3f}{r['host_hit_rate']:>9.3f}"
            f"{r['prefill_tokens']:>12d}{r['prefill_tokens_vs_rr']:>7.2f}"
            f"{r['imbalance']:>7.2f}{r['ttft_mean_s']:>10.3f}{r['ttft_mean_s_vs_rr']:>7.2f}"
            f"{r['ttft_p90_s']:>9.3f}{r['ttft_p90_s_vs_rr']:>7.2f}"
            f"{r['controller_us_per_req']:>8.0f}"
            f"{r['controller_back_to_back_us_per_req']:>6.0f}"
            f"{r['controller_back_to_back_route_us_per_req']:>6.0f}"
            f"{r['controller_back_to_back_us_per_digest']:>6.0f}"
            f"{r['gpu_evicted_tokens']:>9d}"
            + (
                f"{r['digest_bytes_per_publish']:>8.0f}{r['digest_kib_per_s']:>7.0f}"
                if r.get("digest_bytes_per_publish")
                else ""
            )
        )


def _plot(runs, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [f"dp{r['dp']}\n{r['workload']}" for r in runs]
    policies = [row["policy"] for row in runs[0]["rows"]]
    width = 0.8 / len(policies)
    for ax, key, title in (
        (axes[0], "gpu_hit_rate", "GPU prefix hit rate"),
        (axes[1], "prefill_tokens_vs_rr", "prefill tokens vs round_robin"),
        (axes[2], "ttft_mean_s_vs_rr", "modeled mean TTFT vs round_robin"),
    ):
        for j, p in enumerate(policies):
            vals = [next(x for x in r["rows"] if x["policy"] == p)[key] for r in runs]
            ax.bar([i + j * width for i in range(len(runs))], vals, width, label=p)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(runs))])
        ax.set_xticklabels(labels)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()
