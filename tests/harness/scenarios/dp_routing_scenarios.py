"""A real DataParallelController over scheduler stand-ins, for routing tests.

``start_controller`` publishes ``ServerArgs`` for the ``dp_controller`` role
and builds upstream's ``DataParallelController`` with ``scheduler_standin`` as
its ``run_scheduler_process_func``: the controller binds its worker sockets,
forks one stand-in per DP rank and waits for their ready messages exactly as it
does for real schedulers. A stand-in PULLs the requests the controller pushes
to it and reports ``(dp_rank, rid)`` to a sink socket, so a test sees where
each request landed.

With ``tree=True`` a stand-in is the scheduler side of cache-aware routing: it
owns a real ``UnifiedRadixCache`` with KV events, the real
``PrefixDigestPublisher``, inserts the ``input_ids`` of every request it
receives (what a finished request leaves in the cache) and optionally a
preloaded prompt, and publishes its digest over the real channel.

``dispatch_trace`` is the flag-off scenario run by ``harness.compare`` against
pristine upstream and the patched tree: seeded requests and seeded per-rank
loads (written through the real load-snapshot SHM writers) are dispatched by
the controller, and the landing rank of every request is returned.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
import uuid
from array import array

UPSTREAM_TEST_MODULE = "sglang.test.dp_routing_scenarios"

SINK_ENV = "SGLANG_TEST_ROUTING_SINK"
TREE_ENV = "SGLANG_TEST_ROUTING_TREE"


def sglang_identity() -> dict:
    import sglang

    return {"version": sglang.__version__, "file": sglang.__file__}


def scheduler_standin(
    server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe, *display
):
    import zmq
    from sglang.srt.managers.io_struct import sock_recv
    from sglang.srt.utils.network import get_zmq_socket

    # Everything a request needs is imported before "ready" (a spawned
    # stand-in would otherwise import it on its first request).
    ctx = zmq.Context()
    recv = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, False)
    sink = ctx.socket(zmq.PUSH)
    sink.connect(os.environ[SINK_ENV])
    tree_cfg = os.environ.get(TREE_ENV)
    publisher = tree = None
    if tree_cfg:
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

        # What run_scheduler_process publishes for this rank.
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(
                world_rank=spawn_world_rank(
                    server_args, tp_rank=tp_rank, pp_rank=pp_rank
                ),
                dp_rank=dp_rank,
                gpu_id=gpu_id,
            ),
        )
        publisher, tree, kv_events = _standin_cache(port_args, dp_rank, tree_cfg)
    pipe.send(
        {"status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": 4096}
    )
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    while True:
        if poller.poll(20):
            req = sock_recv(recv)
            if tree is not None and getattr(req, "input_ids", None) is not None:
                from harness.stacks.radix_tree_fixtures import insert

                insert(
                    tree,
                    list(req.input_ids),
                    extra_key=req.extra_key,
                    cache_salt=req.cache_salt,
                )
            sink.send_pyobj((dp_rank, req.rid))
        if publisher is not None:
            publisher.maybe_publish(kv_events.publish_kv_events)


def _standin_cache(port_args, dp_rank, tree_cfg):
    import json

    from sglang.srt.managers.dp_routing.publisher import create_prefix_digest_publisher
    from sglang.srt.managers.scheduler_components.kv_events_publisher import (
        SchedulerKvEventsPublisher,
    )

    from harness.stacks.radix_tree_fixtures import build_tree, insert

    cfg = json.loads(tree_cfg)
    # Before build_tree, which publishes the tree's own ServerArgs.
    publisher = create_prefix_digest_publisher(port_args, dp_rank)
    assert publisher is not None, "cache_aware is not on for this stand-in"
    tree = build_tree(cfg["page_size"], cfg.get("backend", "rust"), kv_size=4096)
    publisher.attach(
        tree.page_size,
        lambda: tree.allocator.available_size() + tree.cache.evictable_size(),
    )
    # As the scheduler wires it: KV events off, the digest taps the drain.
    kv_events = SchedulerKvEventsPublisher(
        kv_events_config=None,
        tree_cache=tree.cache,
        send_metrics_from_scheduler=None,
        max_running_requests=64,
        max_total_num_tokens=4096,
        get_stats=lambda: None,
        event_tap=publisher.observe,
    )
    for tokens in cfg.get("preload", {}).get(str(dp_rank), []):
        insert(tree, tokens)
    return publisher, tree, kv_events


def make_req(rid, input_ids, **kwargs):
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    return TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=array("q", input_ids) if input_ids is not None else None,
        input_embeds=kwargs.pop("input_embeds", None),
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        **kwargs,
    )


class ControllerHandle:
    """A controller in this process, its stand-ins, and the landing sink."""

    def __init__(self, controller, sink, sink_endpoint, port_args):
        self.controller = controller
        self.sink = sink
        self.sink_endpoint = sink_endpoint
        self.port_args = port_args

    def dispatch(self, req, timeout=60.0, refresh=True):
        """Dispatch one request through the controller; returns its rank (the
        stand-in schedulers may still be starting on a loaded machine).
        ``refresh=False`` keeps the controller's speculative load counts of
        the previous dispatches (a burst within one load refresh)."""
        import zmq

        if refresh:
            self.controller._last_refresh_time = 0.0
        else:
            self.controller._last_refresh_time = time.perf_counter() + 3600
        self.controller._request_dispatcher(req)
        if not self.sink.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"request {req.rid} did not reach any DP rank")
        rank, rid = self.sink.recv_pyobj()
        assert rid == req.rid, (rid, req.rid)
        return rank

    def close(self):
        for proc in self.controller.scheduler_procs:
            proc.kill()
            proc.join(5)
        self.sink.close()
        router = getattr(self.controller, "cache_aware_router", None)
        if router is not None:
            router.close()


def start_controller(dp_size, *, tree=None, **server_kwargs) -> ControllerHandle:
    import json
    import multiprocessing

    import zmq
    from sglang.srt.arg_groups.serving_hook import handle_load_balance_method
    from sglang.srt.managers.data_parallel_controller import DataParallelController
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    # run_ranks workers are daemonic, and the controller must fork its
    # stand-ins; its launch threads never end, so run_ranks kills the worker
    # once the result is in.
    multiprocessing.current_process()._config["daemon"] = False
    # A rank started by run_ranks' fork server has "forkserver" as its default
    # start method: the controller's stand-ins would fork from a server that
    # this rank started with the first controller's environment (its sink),
    # so a second controller's requests reached a closed sink. Fork them from
    # this process, as a launcher on Linux does.
    multiprocessing.set_start_method("fork", force=True)
    server_args = ServerArgs(model_path="dummy", dp_size=dp_size, **server_kwargs)

    handle_load_balance_method(server_args)
    port_args = PortArgs.init_new(server_args)
    publish(server_args, role="dp_controller")

    sink_endpoint = (
        f"ipc://{tempfile.gettempdir()}/sglang_routing_sink_{uuid.uuid4().hex}.sock"
    )
    sink = zmq.Context.instance().socket(zmq.PULL)
    sink.bind(sink_endpoint)
    os.environ[SINK_ENV] = sink_endpoint
    if tree is not None:
        os.environ[TREE_ENV] = json.dumps(tree)
    else:
        os.environ.pop(TREE_ENV, None)
    controller = DataParallelController(server_args, port_args, scheduler_standin)
    return ControllerHandle(controller, sink, sink_endpoint, port_args)


def write_loads(port_args, loads, skip=()):
    """Publish per-rank (running, waiting, total_tokens) through the real SHM
    load-snapshot writers, as the DP leader schedulers do; the ranks in
    ``skip`` publish nothing (their last snapshot stays)."""
    from sglang.srt.managers.load_snapshot import (
        LoadSnapshot,
        create_load_snapshot_writer,
    )

    now = time.time()
    for rank, (running, waiting, tokens) in enumerate(loads):
        if rank in skip:
            continue
        writer = create_load_snapshot_writer(port_args, len(loads), rank)
        writer.write(
            LoadSnapshot(
                timestamp=now + rank * 1e-6,
                dp_rank=rank,
                num_running_reqs=running,
                num_waiting_reqs=waiting,
                num_total_tokens=tokens,
                max_total_num_tokens=4096,
            )
        )
        writer.close()


def dispatch_trace(rank, world_size, methods=("round_robin",), **kwargs):
    """Flag-off scenario: for each method, the landing ranks of seeded
    requests under seeded loads."""
    return {
        "sglang": sglang_identity(),
        "runs": {m: _dispatch_trace(m, **kwargs) for m in methods},
    }


def _dispatch_trace(method, dp_size=3, seed=0, n=40):
    rng = random.Random(seed)
    handle = start_controller(dp_size, load_balance_method=method)
    try:
        landed = []
        for i in range(n):
            if i % 5 == 0:
                write_loads(
                    handle.port_args,
                    [
                        (rng.randrange(8), rng.randrange(4), rng.randrange(4000))
                        for _ in range(dp_size)
                    ],
                )
            tokens = [rng.randrange(32000) for _ in range(rng.randrange(1, 200))]
            req = make_req(f"r{i}", tokens, bootstrap_room=rng.randrange(1 << 30))
            landed.append(handle.dispatch(req))
        return {
            "method": handle.controller.load_balance_method.name,
            "landed": landed,
        }
    finally:
        handle.close()


# ---------------------------------------------------------------------------
# cache_aware scenarios (patched tree only)
# ---------------------------------------------------------------------------


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


class _DigestSender:
    """Crafted digests on the real channel: what a rank holding ``gpu`` and
    ``host`` prompts would publish (its page hashes at chunk boundaries)."""

    def __init__(self, handle, page_size, chunk_size):
        import zmq
        from sglang.srt.managers.dp_routing.channel import prefix_digest_endpoint

        self.handle = handle
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.socket = zmq.Context.instance().socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(prefix_digest_endpoint(handle.port_args))
        self.seq = {}
        self.pending = {}
        self.state = {}

    def republish(self):
        """Every rank publishes its current state again (a heartbeat), so
        digests stay fresh however slowly the host runs the scenario."""
        for rank, state in list(self.state.items()):
            self.send(rank, **state)
        self.settle()

    def chunks(self, prompts, **ns):
        from sglang.srt.managers.dp_routing.chunk_keys import (
            RequestChunks,
            RequestNamespace,
        )

        out = set()
        for p in prompts:
            namespace = RequestNamespace.of(**ns)
            out.update(
                RequestChunks(p, self.page_size, self.chunk_size, namespace).keys
            )
        return out

    def send(
        self,
        rank,
        gpu=(),
        host=(),
        available=100000,
        capacity=0,
        epoch=1,
        seq=None,
        remember=True,
        **ns,
    ):
        from sglang.srt.managers.dp_routing.digest import CacheDigest, pack_hashes

        if remember:
            self.state[rank] = dict(
                gpu=gpu,
                host=host,
                available=available,
                capacity=capacity,
                epoch=epoch,
                **ns,
            )
        seq = seq if seq is not None else self.seq.get((rank, epoch), 0) + 1
        if remember:
            self.seq[(rank, epoch)] = seq
        digest = CacheDigest(
            dp_rank=rank,
            epoch=epoch,
            seq=seq,
            page_size=self.page_size,
            chunk_size=self.chunk_size,
            timestamp=time.time(),
            available_tokens=available,
            capacity_tokens=capacity,
            gpu_hashes=pack_hashes(self.chunks(gpu, **ns)),
            host_hashes=pack_hashes(self.chunks(host, **ns) - self.chunks(gpu, **ns)),
        )
        self.socket.send(digest.encode())
        self.pending[rank] = (epoch, seq)

    def settle(self, timeout=5.0):
        """Let the controller's load refresh drain every digest sent since the
        last settle (each rank's newest one)."""
        router = self.handle.controller.cache_aware_router
        want = dict(self.pending)
        self.pending.clear()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.handle.controller._last_refresh_time = 0.0
            self.handle.controller.refresh_load_budget()
            seen = {
                r: (d.epoch, d.seq)
                for r, d in enumerate(router.digests.latest)
                if d is not None
            }
            if all(seen.get(r) == v for r, v in want.items()):
                return True
            time.sleep(0.005)
        return False


# DP ranks, page size, digest chunk size, --dp-routing-max-extra-reqs of the
# crafted-digest scenarios.
CRAFTED = (4, 4, 8, 2)


# Server arguments under which a dispatched prefix earns credit from its
# dispatch: no overlap scheduler and a policy with in-batch prefix caching
# (the rank holds back a request sharing a waiting one's prefix until that
# prefill is in the tree). Under the defaults it earns credit from its landing.
CREDIT_ON_DISPATCH = dict(disable_overlap_schedule=True, schedule_policy="lpm")


def _crafted_controller(max_age, pending_ttl, **server_kwargs):
    dp, page, chunk, max_extra = CRAFTED
    handle = start_controller(
        dp,
        load_balance_method="cache_aware",
        page_size=page,
        dp_routing_digest_chunk_size=chunk,
        dp_routing_max_extra_reqs=max_extra,
        dp_routing_digest_max_age=max_age,
        dp_routing_pending_ttl=pending_ttl,
        **server_kwargs,
    )
    sender = _DigestSender(handle, page, chunk)
    return handle, sender, handle.controller.cache_aware_router


def cache_aware_cases(rank, world_size):
    """Crafted loads and digests through the real controller dispatch path.

    Returns ``{case: (landed_rank, how)}``; ``how`` is the router counter the
    dispatch incremented."""
    # Crafted digests alone decide here (pending_cases covers pending).
    dp, page, chunk, max_extra = CRAFTED
    max_age = 3.0
    handle, sender, router = _crafted_controller(max_age=max_age, pending_ttl=0.0)
    # The router's clock, advanced past the max age for the stale case
    # instead of sleeping through it.
    clock = router.clock = FakeClock()
    router.stalls.restart(clock())
    out = {}
    n = [0]

    def run(case, tokens, loads=((0, 0, 0),) * dp, fresh=True, history=False, **kwargs):
        if fresh:
            sender.republish()
        if not history:  # the crafted loads alone decide
            clear_dispatch_history(router)
        write_loads(handle.port_args, list(loads))
        before = dict(router.stats)
        n[0] += 1
        landed = handle.dispatch(make_req(f"{case}-{n[0]}", tokens, **kwargs))
        how = [k for k, v in router.stats.items() if v != before.get(k, 0)]
        out[case] = (landed, how[0] if len(how) == 1 else how)

    try:
        a, b = _prompt(1, 64), _prompt(2, 64)
        suffix = _prompt(3, 10)
        out["method"] = handle.controller.load_balance_method.name
        # No digest yet: load balancing.
        run("no_digest", a + suffix, loads=[(3, 0, 0), (1, 0, 0), (2, 0, 0), (5, 0, 0)])
        for r in range(dp):
            sender.send(r)
        sender.send(2, gpu=[a])
        sender.send(1, gpu=[b], host=[a])
        out["settled"] = sender.settle()
        # Misses while every rank reads idle spread over all ranks: the least
        # recently dispatched first, equally loaded ones in turn after the
        # last chosen rank (rank 1 got no_digest): no lowest-index bias.
        spread = []
        for i in range(dp):
            run(f"spread-{i}", _prompt(20 + i, 40), history=i > 0)
            spread.append(out.pop(f"spread-{i}"))
        out["miss_spread"] = spread
        run("best_match", a + suffix)
        run("best_match_b", b + suffix)
        # Recent dispatches count as load: after 3 requests matched on rank 2
        # and one on rank 1 the turn is rank 2's, but a miss on idle ranks
        # goes to rank 3, which got none.
        for i in range(3):
            run(f"recent-{i}", a + _prompt(90 + i, 10), history=i > 0)
        run("recent-b", b + suffix, history=True)
        run("miss_avoids_recent", _prompt(95, 40), history=True)
        run(
            "no_match",
            _prompt(9, 40),
            loads=[(3, 0, 0), (2, 0, 0), (1, 0, 0), (4, 0, 0)],
        )
        # Host hits weigh less: rank 3 holds 56 tokens of `a` on GPU, rank 1
        # all 64 on host (0.75 * 64 = 48 < 56).
        sender.send(3, gpu=[a[:56]])
        sender.send(2)
        sender.send(1, gpu=[b], host=[a])
        sender.settle()
        run("gpu_beats_longer_host", a + suffix)
        # ... but a long enough host match wins over a short GPU one.
        sender.send(3, gpu=[a[:40]])
        sender.send(1, gpu=[b], host=[a])
        sender.settle()
        run("host_beats_short_gpu", a + suffix)
        sender.send(3)
        sender.send(1, gpu=[b])
        sender.send(2, gpu=[a])
        sender.settle()
        # Override: best rank 2 has exactly max_extra over the least loaded ...
        run(
            "extra_at_threshold",
            a + suffix,
            loads=[(1, 0, 0), (3, 0, 0), (1 + max_extra, 0, 0), (2, 0, 0)],
        )
        # ... and one more.
        run(
            "extra_over_threshold",
            a + suffix,
            loads=[(1, 0, 0), (3, 0, 0), (2 + max_extra, 0, 0), (2, 0, 0)],
        )
        run(
            "extra_waiting_counts",
            a + suffix,
            loads=[(1, 0, 0), (3, 0, 0), (1, 2 + max_extra, 0), (2, 0, 0)],
        )
        # Capacity: rank 2 (all of `a`) has no room for the 10 uncached
        # tokens right now but could hold them: the request waits there
        # rather than recompute 32 tokens on rank 0 (half of `a`, room).
        sender.send(2, gpu=[a], available=5, capacity=1000)
        sender.send(0, gpu=[a[:32]], available=1000)
        sender.settle()
        run("capacity_waits_on_best", a + suffix)
        # ... it moves where it loses no cached token: rank 0 holds all of `a`
        # on host and has room (rank 0 is less loaded than rank 3).
        sender.send(0, host=[a], available=1000)
        sender.send(3, host=[a], available=1000)
        sender.settle()
        run(
            "capacity_same_prefix_elsewhere",
            a + suffix,
            loads=[(0, 0, 0), (1, 0, 0), (0, 0, 0), (1, 0, 0)],
        )
        sender.send(3)
        # ... and where the best rank cannot hold it even empty: the next best
        # that can (rank 0, half of `a`) ...
        sender.send(2, gpu=[a], available=5, capacity=5)
        sender.send(0, gpu=[a[:32]], available=1000)
        sender.settle()
        run("capacity_next_best", a + suffix)
        # ... else the least-loaded rank.
        sender.send(0, available=1000)
        sender.settle()
        run(
            "capacity_least_loaded",
            a + suffix,
            loads=[(2, 0, 0), (0, 0, 0), (2, 0, 0), (1, 0, 0)],
        )
        sender.send(2, gpu=[a], available=1000)
        sender.settle()
        # Namespaces: a salted request never matches the unsalted digest.
        run(
            "salted",
            a + suffix,
            loads=[(1, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0)],
            cache_salt="tenant-x",
        )
        sender.send(3, gpu=[a], cache_salt="tenant-x")
        sender.settle()
        run("salted_own_digest", a + suffix, cache_salt="tenant-x")
        # Requests whose controller tokens are not the tree key.
        run(
            "input_embeds",
            None,
            loads=[(2, 0, 0), (2, 0, 0), (0, 0, 0), (1, 0, 0)],
            input_embeds=[[0.0] * 4] * 8,
        )
        # Tie: ranks 0 and 2 both hold `a`; the less loaded of them wins.
        sender.send(0, gpu=[a])
        sender.send(2, gpu=[a])
        sender.settle()
        run("tie", a + suffix, loads=[(2, 0, 0), (0, 0, 0), (1, 0, 0), (0, 0, 0)])
        # Without pending prefixes a burst sharing a new prefix scatters
        # (every rank's digest lacks it until one prefills it).
        burst = _prompt(30, 48)
        out["burst_without_pending"] = []
        for i in range(3):
            run(f"burst-{i}", burst + _prompt(40 + i, 6))
            out["burst_without_pending"].append(out.pop(f"burst-{i}"))
        # Flush on rank 2 (empty digest, same epoch) and rank 0 restarted
        # (new epoch, seq restarts): the prefix is gone.
        sender.send(2)
        sender.send(0, epoch=2, seq=1)
        sender.settle()
        run(
            "after_flush",
            a + suffix,
            loads=[(0, 0, 0), (1, 0, 0), (1, 0, 0), (1, 0, 0)],
        )
        # An out-of-order older digest of rank 2 is ignored.
        sender.send(2, gpu=[a], seq=1, remember=False)
        sender.settle(timeout=0.3)
        run(
            "old_seq_ignored",
            a + suffix,
            loads=[(0, 0, 0), (1, 0, 0), (1, 0, 0), (1, 0, 0)],
        )
        # Stale: nothing published for longer than --dp-routing-digest-max-age.
        sender.send(2, gpu=[a], epoch=3, seq=1)
        sender.settle()
        run("fresh_again", a + suffix)
        clock.now += max_age + 0.2
        run(
            "stale",
            a + suffix,
            loads=[(1, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0)],
            fresh=False,
        )
        out["stats"] = dict(router.stats)
        return out
    finally:
        handle.close()


def _probes(handle, router, refresh_default):
    """``go(rid, tokens)``: dispatch through the controller, returns
    ``(landed_rank, how)``; ``pending_sizes()``: the keys pending per rank."""

    def go(rid, tokens, refresh=refresh_default):
        before = dict(router.stats)
        landed = handle.dispatch(make_req(rid, tokens), refresh=refresh)
        return landed, _changed(router.stats, before)

    def pending_sizes():
        return [len(router.pending.expiry[r]) for r in range(router.num_dp_ranks)]

    return go, pending_sizes


def _settle_idle(handle, sender):
    """Every rank idle, with an empty digest; True once the router has them."""
    dp = CRAFTED[0]
    write_loads(handle.port_args, [(0, 0, 0)] * dp)
    for r in range(dp):
        sender.send(r)
    return sender.settle()


def pending_cases(rank, world_size, ttl=1.0):
    """Pending prefixes through the real controller: a burst sharing a new
    prefix, confirmation by a digest, expiry after the TTL, a restart.
    Returns ``(landed_rank, how)`` per request and pending sizes per rank."""
    dp, page, chunk, max_extra = CRAFTED
    handle, sender, router = _crafted_controller(
        max_age=30.0, pending_ttl=ttl, **CREDIT_ON_DISPATCH
    )
    # The router's clock: real time, advanced past the TTL for the expiry
    # case instead of sleeping through it.
    clock = router.clock = AdvancingClock()
    out = {"credit_on_landing": router.credit_on_landing}
    go, pending_sizes = _probes(handle, router, refresh_default=True)

    try:
        out["settled"] = _settle_idle(handle, sender)
        p = _prompt(50, 48)
        # Within one load refresh: the first request misses, the next ones
        # follow it while the load check allows (max_extra 2), then override.
        out["burst"] = [
            go(f"b{i}", p + _prompt(60 + i, 8), refresh=i == 0)
            for i in range(max_extra + 2)
        ]
        first = out["burst"][0][0]
        out["pending_after_burst"] = pending_sizes()
        # A digest without the prefix (its prefill still queued) keeps it.
        sender.send(first)
        sender.settle()
        out["pending_after_empty_digest"] = pending_sizes()
        # The digest that shows the first request's prompt confirms what the
        # controller hashed of it (the test says which).
        sender.send(first, gpu=[p + _prompt(60, 8)])
        sender.settle()
        out["pending_after_confirm"] = pending_sizes()
        # Expiry: a new prefix, followed once, then nothing confirms it.
        q = _prompt(70, 48)
        write_loads(handle.port_args, [(0, 0, 0)] * dp)
        out["expiring"] = go("e0", q + _prompt(71, 4))
        out["before_ttl"] = go("e1", q + _prompt(72, 4))
        clock.advance(ttl + 0.2)
        sender.republish()
        loads = [(0, 0, 0)] * dp
        loads[out["expiring"][0]] = (1, 0, 0)
        write_loads(handle.port_args, loads)
        out["after_ttl"] = go("e2", q + _prompt(73, 4))
        # A restarted rank (new epoch) drops what was pending on it.
        restarted, _ = go("r0", _prompt(80, 48))
        out["pending_before_restart"] = len(router.pending.expiry[restarted])
        sender.send(restarted, epoch=9, seq=1)
        sender.settle()
        out["pending_after_restart"] = len(router.pending.expiry[restarted])
        out["stats"] = dict(router.stats)
        return out
    finally:
        handle.close()


def send_landing(handle, rank, landings, timeout=30.0):
    """A rank's ``PrefillLanded`` on the real landing channel: ``landings``
    is ``[(rid, upto), ...]``; returns once the router has taken it (as the
    next dispatch would first)."""
    import zmq
    from sglang.srt.managers.dp_routing.channel import prefill_landing_endpoint
    from sglang.srt.managers.dp_routing.landing import PrefillLanded

    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 1000)
    socket.connect(prefill_landing_endpoint(handle.port_args))
    message = PrefillLanded(
        dp_rank=rank, rids=[r for r, _ in landings], upto=[u for _, u in landings]
    )
    socket.send(message.encode())
    socket.close()
    router = handle.controller.cache_aware_router
    if not router.landing_receiver.socket.poll(int(timeout * 1000)):
        raise TimeoutError(f"landing of rank {rank} not delivered in {timeout} s")
    router.drain_landings()


def landing_cases(rank, world_size, ttl=30.0):
    """Prefill landings through the real controller under the default
    scheduler (overlap on, fcfs): a dispatched prefix earns credit on its
    rank only from its landing on. Returns ``(landed_rank, how)`` per
    request and the pending sizes per rank."""
    dp, page, chunk, max_extra = CRAFTED
    handle, sender, router = _crafted_controller(max_age=30.0, pending_ttl=ttl)
    out = {"credit_on_landing": router.credit_on_landing}
    go, pending_sizes = _probes(handle, router, refresh_default=False)

    try:
        out["settled"] = _settle_idle(handle, sender)
        p = _prompt(50, 48)  # six chunks of 8
        # A burst within one load refresh, no landing yet: nothing to reuse,
        # each request goes to the least loaded rank.
        out["burst"] = [go(f"b{i}", p + _prompt(60 + i, 8)) for i in range(dp)]
        out["pending_before_landing"] = pending_sizes()
        out["in_flight"] = len(router.in_flight)
        first = out["burst"][0][0]
        # The first request's rank reports its landing, one chunk short of a
        # second (15 tokens); a wrong rank's report of it credits nothing.
        send_landing(handle, (first + 1) % dp, [("b0", 48)])
        send_landing(handle, first, [("b0", 2 * chunk - 1)])
        out["partial"] = go("p0", p + _prompt(70, 8))
        out["pending_after_partial"] = pending_sizes()
        # The whole prompt lands: the next request follows.
        send_landing(handle, first, [("b0", 56)])
        out["after_landing"] = go("a0", p + _prompt(71, 8))
        out["pending_after_landing"] = pending_sizes()
        # A landing of a rid never dispatched credits nothing, not even the
        # request in flight on that rank (a fresh prefix, not landed yet).
        rank_u, _ = go("u0", _prompt(90, 48))
        out["pending_before_unknown"] = pending_sizes()
        send_landing(handle, rank_u, [("unknown", 56)])
        out["pending_after_unknown"] = pending_sizes()
        entry = router.in_flight.entries.get("u0")  # gone once credited whole
        out["u0_credited"] = entry.credited if entry is not None else None
        # ... and that request's own landing does (the control of the above)
        send_landing(handle, rank_u, [("u0", 48)])
        out["pending_after_u0"] = pending_sizes()
        out["rank_u"] = rank_u
        # A request its client sent to a rank itself (routed_dp_rank, as a
        # gateway's --dp-aware does), not the rank the router would pick: it
        # counts as outcome external, and from its landing on its prefix
        # draws its followers there like any dispatched prefix.
        ext = (out["after_landing"][0] + 2) % dp
        requests_before = list(handle.controller.dp_budget.total_requests)
        q = _prompt(95, 48)
        before = dict(router.stats)
        landed = handle.dispatch(make_req("e0", q, routed_dp_rank=ext), refresh=False)
        out["external"] = (ext, landed, _changed(router.stats, before))
        out["external_requests"] = [
            a - b
            for a, b in zip(handle.controller.dp_budget.total_requests, requests_before)
        ]
        send_landing(handle, ext, [("e0", 48)])
        out["after_external_landing"] = go("e1", q + _prompt(96, 8))
        out["stats"] = dict(router.stats)
        return out
    finally:
        handle.close()


def _changed(stats, before):
    how = [k for k, v in stats.items() if v != before.get(k, 0)]
    return how[0] if len(how) == 1 else how


def clear_dispatch_history(router):
    """Forget the router's recent dispatches (the crafted loads alone decide)."""
    router.load.clear_history(router.clock())


class AdvancingClock:
    """Monotonic time plus what the scenario has advanced it by."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self):
        return time.monotonic() + self.offset

    def advance(self, seconds):
        self.offset += seconds


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def stall_cases(rank, world_size, max_age=3.0):
    """Stalled ranks through the real controller, on the router's clock (a
    ``FakeClock`` the scenario advances). Rank 1 holds prompt ``a`` and has
    the lightest load snapshot; then it stops publishing digests and loads
    while the other ranks go on. Returns ``(landed_rank, how)`` per request,
    the warnings and infos the router logged, and its counters."""
    import logging

    dp = CRAFTED[0]
    handle, sender, router = _crafted_controller(max_age=max_age, pending_ttl=0.0)
    clock = router.clock = FakeClock()
    clear_dispatch_history(router)
    router.stalls.restart(clock())
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    log = logging.getLogger("sglang.srt.managers.dp_routing")
    capture = Capture(level=logging.INFO)
    log.addHandler(capture)
    level = log.level
    log.setLevel(logging.INFO)
    out = {}
    n = [0]
    others = [r for r in range(dp) if r != 1]
    # Queued requests: rank 1 is the least loaded (its frozen snapshot), then
    # 2, 3, 0 (the override threshold is 2 requests over the least loaded).
    loads = [(4, 2, 0), (0, 0, 0), (3, 1, 0), (3, 2, 0)]

    def go(case, tokens, publish=others, load_skip=(1,)):
        # Loads first: the digests' settle refreshes the budget and the stalls.
        write_loads(handle.port_args, loads, skip=load_skip)
        for r in publish:
            sender.send(r, **sender.state[r])
        sender.settle()
        clear_dispatch_history(router)
        before = dict(router.stats)
        n[0] += 1
        landed = handle.dispatch(make_req(f"{case}-{n[0]}", tokens))
        how = [k for k, v in router.stats.items() if v != before.get(k, 0)]
        out[case] = (landed, how[0] if len(how) == 1 else how)

    try:
        a, b = _prompt(91, 64), _prompt(92, 64)
        for r in range(dp):
            sender.send(r, gpu=[a] if r == 1 else [b] if r == 2 else [])
        out["settled"] = sender.settle()
        go("before_new", _prompt(93, 40), publish=range(dp), load_skip=())
        go("before_prefix", a + _prompt(94, 8), publish=range(dp), load_skip=())
        # Rank 1's digest goes stale, but its load snapshot still advances:
        # a busy rank, not a stalled one.
        clock.now += max_age + 1
        go("busy_new", _prompt(95, 40), load_skip=())
        # Then its load stops too: stalled once both are older than max_age.
        go("load_just_stopped", _prompt(96, 40))
        clock.now += max_age + 1
        go("stalled_new", _prompt(97, 40))
        go("stalled_prefix", a + _prompt(98, 8))
        go("stalled_other_match", b + _prompt(99, 8))
        out["stalled_set"] = sorted(router.stalls.stalled)
        # Every rank quiet: no live rank to move to, routing as without stalls.
        clock.now += max_age + 1
        go("all_quiet", _prompt(100, 40), publish=(), load_skip=range(dp))
        out["all_stalled_set"] = sorted(router.stalls.stalled)
        # Rank 1 reports again (digest and load): routed to by its prefix.
        go("recovered_prefix", a + _prompt(101, 8), publish=range(dp), load_skip=())
        go("recovered_new", _prompt(102, 40), publish=range(dp), load_skip=())
        out["recovered_set"] = sorted(router.stalls.stalled)
        out["log"] = list(records)
        out["stats"] = dict(router.stats)
        return out
    finally:
        log.removeHandler(capture)
        log.setLevel(level)
        handle.close()


def cache_aware_end_to_end(rank, world_size, dp=3, tree_core="rust", turns=3):
    """Scheduler stand-ins with real trees and publishers -> real channel ->
    controller. Returns the landing ranks of each step."""
    page, chunk = 4, 16
    prompts = {str(r): [_prompt(100 + r, 96)] for r in range(dp)}
    handle = start_controller(
        dp,
        load_balance_method="cache_aware",
        page_size=page,
        dp_routing_digest_chunk_size=chunk,
        dp_routing_digest_publish_interval=0.05,
        tree={"page_size": page, "backend": tree_core, "preload": prompts},
    )
    router = handle.controller.cache_aware_router
    out = {"method": handle.controller.load_balance_method.name}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(router.digests.latest):
            handle.controller._last_refresh_time = 0.0
            handle.controller.refresh_load_budget()
            time.sleep(0.02)
        out["digests"] = [d is not None and len(d.gpu) for d in router.digests.latest]
        out["shared_prompt"] = []
        for i in range(2 * dp):
            r = i % dp
            tokens = prompts[str(r)][0] + _prompt(1000 + i, 20)
            out["shared_prompt"].append((r, handle.dispatch(make_req(f"s{i}", tokens))))
        # Multi-turn: a new conversation lands by load (rank dp-1 is now the
        # least loaded), then its later turns follow it once that rank's
        # digest has the first turn.
        for i in range(dp - 1):
            tokens = prompts[str(i)][0] + _prompt(2000 + i, 20)
            out["shared_prompt"].append((i, handle.dispatch(make_req(f"x{i}", tokens))))
        conv = _prompt(7, 40)
        turns_landed = []
        for t in range(turns):
            if t:
                wait_for_match(handle, conv)
            turns_landed.append(handle.dispatch(make_req(f"c{t}", conv)))
            conv = conv + _prompt(200 + t, 24)
        out["turns"] = turns_landed
        out["stats"] = dict(router.stats)
        return out
    finally:
        handle.close()


def wait_for_match(handle, tokens, timeout=10.0):
    from sglang.srt.managers.dp_routing.request import RoutedRequest

    router = handle.controller.cache_aware_router
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        handle.controller._last_refresh_time = 0.0
        handle.controller.refresh_load_budget()
        req = RoutedRequest.of(make_req("probe", tokens))
        digests = router.fresh_digests(range(router.num_dp_ranks))
        if any(m.total_len for m in router.estimate(req, digests).matches.values()):
            return True
        time.sleep(0.02)
    return False


# A PD decode worker's controller (--disaggregation-mode decode with the decode
# radix cache): a decode rank matches a request against its tree when it
# pre-allocates it; the transferred KV of an earlier request is there only once
# its prebuilt batch was formed (process_prebuilt checkpoints it), which the DP
# leader reports as a landing.
DECODE = dict(
    disaggregation_mode="decode",
    disaggregation_decode_enable_radix_cache=True,
)


def decode_landing_cases(rank, world_size, ttl=30.0):
    """A burst of one new prompt before its decode landing spreads by load;
    once the first request's decode rank reports the landing, a follower
    goes there by its match. Returns ``(landed_rank, how)`` per request and
    the pending sizes per rank."""
    dp, page, chunk, max_extra = CRAFTED
    handle, sender, router = _crafted_controller(
        max_age=30.0, pending_ttl=ttl, **DECODE
    )
    out = {
        "credit_on_landing": router.credit_on_landing,
        "landing_receiver": router.landing_receiver is not None,
    }
    go, pending_sizes = _probes(handle, router, refresh_default=False)
    try:
        out["settled"] = _settle_idle(handle, sender)
        p = _prompt(50, 48)  # six chunks of 8
        # Transfers still in flight: no decode rank holds the prefix yet.
        out["burst"] = [go(f"b{i}", p + _prompt(60 + i, 8)) for i in range(dp)]
        out["pending_before_landing"] = pending_sizes()
        out["in_flight"] = len(router.in_flight)
        first = out["burst"][0][0]
        # The first request's prebuilt batch put its prompt (56 tokens) in
        # the decode tree of its rank.
        if router.landing_receiver is not None:  # none: credited at dispatch
            send_landing(handle, first, [("b0", 56)])
        out["pending_after_landing"] = pending_sizes()
        out["after_landing"] = go("a0", p + _prompt(71, 8))
        out["stats"] = dict(router.stats)
        return out
    finally:
        handle.close()
