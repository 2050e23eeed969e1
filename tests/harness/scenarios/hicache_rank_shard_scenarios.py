"""Multi-rank scenarios for the rank-sharded HiCache host tier.

Each function runs on one rank of a ``harness.gloo_ranks.run_ranks`` gloo group
(one process per TP rank). Every rank builds the same DSA stack through
upstream's ``_DsaStrategy.build`` (patched: it shards when
``SGLANG_ENABLE_HICACHE_RANK_SHARD=1``) and fills its device pool with the
same seeded data, as replicated TP ranks hold identical KV.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from harness.scenarios.hicache_l2_scenarios import (
    normalize_trace,
    random_like,
    sglang_identity,
    write_random_node,
)

UPSTREAM_TEST_MODULE = "sglang.test.hicache_rank_shard_scenarios"


def require_rank_shard() -> None:
    """The first check of every rank-shard PR test, made before any of the
    PR's modules is imported: ``SGLANG_ENABLE_HICACHE_RANK_SHARD`` is a known
    env of sglang's ``environ.envs``. Without the PR it fails by this
    assertion, not by an import error."""
    from sglang.srt.environ import envs

    if not hasattr(envs, "SGLANG_ENABLE_HICACHE_RANK_SHARD"):
        raise AssertionError(
            "SGLANG_ENABLE_HICACHE_RANK_SHARD is not an env of "
            "sglang.srt.environ.envs: the hicache-rank-shard PR is missing"
        )


def _count_calls(module, name: str) -> list:
    """Record every ``module.<name>`` call made from now on: its positional
    and keyword arguments."""
    calls = []
    original = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(module, name, counting)
    return calls


def _wire_bytes(broadcasts: list, rank: int) -> dict:
    """Bytes this rank put on the wire as a broadcast source and took off it
    as a receiver, from the tensors handed to ``dist.broadcast`` (not the
    exchange's own counters)."""
    sent = received = 0
    for args, kwargs in broadcasts:
        tensor = args[0] if args else kwargs["tensor"]
        src = args[1] if len(args) > 1 else kwargs["src"]
        nbytes = tensor.numel() * tensor.element_size()
        if src == rank:
            sent += nbytes
        else:
            received += nbytes
    return dict(wire_sent=sent, wire_received=received)


def disable_exchange(cc) -> None:
    """Negative control: load events fire, but no layer is broadcast."""

    def no_exchange(layer_id, transfers, on_layer_done=None):
        if on_layer_done is not None:
            on_layer_done(layer_id)

    cc.rank_shard.exchange.exchange_layer = no_exchange


def _l3_page_access(controller, *host_pools) -> dict | None:
    """Per host pool of a sharded stack (by its class name): which accessors
    it refuses (those that describe it as whole-layer slabs), whether its
    flat page and its zero-copy page buffer meta (Mooncake's puts and gets)
    address the same bytes, its own layers' page (a random page written
    through the flat accessor and read back through the meta's pointers), and
    whether attaching a storage backend the tier does not cover is refused."""
    import ctypes

    import torch
    from sglang.srt.mem_cache.hicache_rank_shard.host_pools import L3_PAGE_ACCESSORS

    pools = {}
    for pool in host_pools:
        if pool is None:
            continue
        has, refused = [], []
        for name in L3_PAGE_ACCESSORS:
            if not hasattr(pool, name):
                continue
            has.append(name)
            try:
                getattr(pool, name)()
            except AssertionError as e:
                if "rank-sharded" in str(e):
                    refused.append(name)
        page_index = pool.page_size  # the second page: a non-zero offset
        dummy = pool.get_dummy_flat_data_page()
        written = torch.randint(0, 255, (dummy.numel() * dummy.element_size(),))
        written = written.to(torch.uint8).view(dummy.dtype)
        pool.set_from_flat_data_page(page_index, written)
        page = pool.get_data_page(page_index, flat=True)
        ptrs, sizes = pool.get_page_buffer_meta(
            torch.arange(page_index, page_index + pool.page_size)
        )
        meta = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
        pools[type(pool).__name__] = dict(
            has=has,
            refused=refused,
            flat=page.numel() == dummy.numel(),
            flat_bytes=written.view(torch.uint8).numpy().tobytes()
            == page.view(torch.uint8).numpy().tobytes(),
            meta_is_page=meta == page.contiguous().view(torch.uint8).numpy().tobytes(),
            meta_bytes=sum(sizes),
            page_bytes=page.numel() * page.element_size(),
        )
    try:
        controller.attach_storage_backend("nixl")
        attach = None
    except ValueError as e:
        attach = str(e)
    return dict(pools=pools, attach_storage_backend=attach)


def _extra(model: str = "dsa"):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    if model == "mla":
        return None
    return [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]


def sharded_roundtrip(
    rank: int,
    world_size: int,
    *,
    seed: int = 0,
    steps: int = 30,
    layer_num: int = 7,
    skip_topk_layers=None,
    skip_exchange: bool = False,
    diverge_rank: int | None = None,
    direct_submit: bool = False,
    size: int = 1024,
    count_groups: bool = False,
    staging_bytes: int | None = None,
    model: str = "dsa",
) -> dict:
    """Writes, device evictions, load-backs and host evictions; after every
    load-back every rank checks its device rows (KV and indexer) bit for bit.

    Negative controls: ``skip_exchange`` disables the owner broadcast;
    ``diverge_rank`` makes that rank's host allocator hand out different
    slots; ``direct_submit`` submits a load-back outside ``start_loading``.
    ``staging_bytes`` shrinks the exchange's staging buffer below the 1 MB
    that SGLANG_HICACHE_RANK_SHARD_STAGING_MB allows, so that a layer is
    broadcast in several chunks. The rank-shard log lines
    (SGLANG_HICACHE_RANK_SHARD_LOG_EVERY) are returned as ``log``.
    ``model="mla"`` runs a plain MLA stack (no indexer pool).
    """
    import logging

    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state

    from harness.stacks.dsa_hicache_stack import build_dsa_stack
    from standins import cpu_kvcacheio_standin as kvcacheio

    groups = (
        _count_calls(parallel_state, "create_custom_parallel_group")
        if count_groups
        else None
    )
    if model == "mla":
        skip = (True,) * layer_num  # no indexer
    else:
        skip = tuple(skip_topk_layers) if skip_topk_layers else (False,) * layer_num
    stack = build_dsa_stack(
        rank,
        world_size,
        model=model,
        layer_num=layer_num,
        skip_topk_layers=skip,
        size=size,
    )

    def extra():  # a fresh transfer list per call (the controller fills it in)
        return _extra(model)

    pool, alloc, cc = stack.device_pool, stack.allocator, stack.controller
    cc.load_fence_stream = torch.cpu.current_stream()
    shard = getattr(cc, "rank_shard", None)
    broadcasts = _count_calls(dist, "broadcast")  # the exchange's, from here on
    # The staging buffer exists from startup (the controller's constructor), at
    # its configured size.
    staging_at_start = (
        None
        if shard is None or shard.exchange._staging is None
        else shard.exchange._staging.numel()
    )
    if skip_exchange and shard is not None:
        disable_exchange(cc)
    log = []

    class _Keep(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())

    shard_logger = logging.getLogger("sglang.srt.mem_cache.hicache_rank_shard")
    shard_logger.addHandler(_Keep())
    shard_logger.setLevel(logging.INFO)
    if staging_bytes is not None and shard is not None:
        shard.exchange.staging_bytes = staging_bytes  # reallocated at the next load
    ps = stack.page_size
    live_ix = [i for i, s in enumerate(skip) if not s]

    def pages(dev):
        return dev[::ps] // ps

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for buf in list(pool.kv_buffer) + [
        pool.index_k_with_scale_buffer[i] for i in live_ix
    ]:
        buf.copy_(random_like(buf, gen))
    if diverge_rank == rank:
        stack.kv_host.alloc(ps)  # this rank's host slots now differ from its peers'

    names = stack.buffer_names()
    kvcacheio.start_trace()
    nodes, events, mismatches, next_id = {}, [], [], 1
    for step in range(steps):
        op = rng.choice(["write", "write", "load", "load", "evict_host"])
        if op == "write" or not nodes:
            dev = alloc.alloc(ps * rng.randint(1, 4))
            if dev is None:
                events.append(("write", "no device space"))
                continue
            node = write_random_node(
                pool,
                cc,
                dev,
                node_id=next_id,
                live_ix=live_ix,
                gen=gen,
                extra_pools=extra(),
            )
            if node is None:
                alloc.free(dev)
                events.append(("write", "no host space"))
                continue
            nodes[next_id] = node
            host = node["host"]
            events.append(("write", next_id, host.tolist()))
            next_id += 1
            alloc.free(dev)  # the device copy is evicted; its rows get reused
            for l in range(layer_num):
                pool.kv_buffer[l][dev] = random_like(pool.kv_buffer[l][dev], gen)
            for l in live_ix:
                ix = pool.index_k_with_scale_buffer[l]
                ix[pages(dev)] = random_like(ix[pages(dev)], gen)
        elif op == "load":
            node_id = rng.choice(sorted(nodes))
            node = nodes[node_id]
            if direct_submit:
                return _direct_submit(cc, node["host"], alloc)
            dev = cc.load(node["host"], node_id=node_id, extra_pools=extra())
            if dev is None:
                events.append(("load", node_id, "no device space"))
                continue
            cc.start_loading()
            for l in range(layer_num):
                if not torch.equal(pool.kv_buffer[l][dev], node["kv"][l]):
                    mismatches.append((step, "kv", l))
            for l, rows in node["ix"].items():
                if not torch.equal(pool.index_k_with_scale_buffer[l][pages(dev)], rows):
                    mismatches.append((step, "indexer", l))
            events.append(("load", node_id, dev.tolist()))
            alloc.free(dev)
        else:
            node_id = rng.choice(sorted(nodes))
            cc.evict_host(nodes.pop(node_id)["host"])
            events.append(("evict_host", node_id))
    trace = normalize_trace(kvcacheio.stop_trace(), names)
    dist.barrier()
    l3 = (
        _l3_page_access(cc, stack.kv_host, stack.indexer_host)
        if shard is not None
        else None
    )
    return dict(
        rank=rank,
        sglang=sglang_identity(),
        groups_created=len(groups) if groups is not None else None,
        sharded=shard is not None,
        staging_at_start=staging_at_start,
        kv_host_layers=list(stack.kv_host._target_layer_indices),
        indexer_host_layers=(
            list(stack.indexer_host._live_target_layers) if stack.indexer_host else []
        ),
        kv_host_size=stack.kv_host.size,
        kv_host_bytes=stack.kv_host.kv_buffer.numel(),
        indexer_host_bytes=(
            stack.indexer_host.index_k_with_scale_buffer.numel()
            if stack.indexer_host
            else 0
        ),
        events=events,
        mismatches=mismatches,
        trace=trace,
        gate_event_set=(shard is not None and shard.gate.event is not None),
        bytes_sent=shard.exchange.bytes_sent if shard else 0,
        bytes_received=shard.exchange.bytes_received if shard else 0,
        broadcasts=len(broadcasts),
        **_wire_bytes(broadcasts, dist.get_rank()),
        log=log,
        l3_page_access=l3,
    )


def _direct_submit(cc, host, alloc) -> dict:
    """A load-back through the engine without start_loading (as the PD-decode
    retraction restore does): must raise on a sharded pool."""
    dev = alloc.alloc(host.numel())
    transfers = cc._l2_load_transfers(host, dev, None)
    try:
        cc.l2_transfer_engine.submit_host_to_device(
            transfers, transfer_layer_id_max=cc.transfer_layer_id_max
        )
    except RuntimeError as e:
        return dict(raised=str(e))
    return dict(raised=None)


def inactive_reasons(rank: int, world_size: int, *, tp_size: int, **overrides):
    """The activation check's reasons for a freshly published ServerArgs."""
    from sglang.srt.mem_cache.hicache_rank_shard.config import (
        rank_shard_inactive_reasons,
    )

    from harness.stacks.dsa_hicache_stack import dsa_device_pool, publish_server_args

    publish_server_args(rank, tp_size, **overrides)
    return rank_shard_inactive_reasons(dsa_device_pool())


class _StopAfterGate(Exception):
    pass


class _RecordingStream:
    """Stand-in for a CUDA stream: records which event it was made to wait on."""

    def __init__(self, name, waits):
        self.name, self.waits = name, waits

    def wait_event(self, event):
        self.waits.append((self.name, id(event)))


def _run_batch_until_gate(gate, *, overlap: bool, waits: list) -> bool:
    """Run the real ``Scheduler.run_batch`` on a stand-in scheduler instance (a
    real one needs a GPU model) until the first statement after the gate."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler import Scheduler

    class SchedulerStandIn:
        metrics_reporter = SimpleNamespace(record_scheduler_active=lambda ts: None)
        profiler_manager = SimpleNamespace(_profile_batch_predicate=lambda b: None)
        forward_ct = 0
        processed_tokens_counter = 0
        scripted_scheduler_hook = None
        forward_sleep_time = None
        scheduler_stage_metrics = None  # stage timing off
        _sched_idled = False
        rank_shard_gate = gate
        enable_overlap = overlap
        forward_stream = _RecordingStream("forward", waits)

        @property
        def disaggregation_mode(self):  # first read after the gate
            raise _StopAfterGate

    mode = SimpleNamespace(is_split_prefill=lambda: False, is_prebuilt=lambda: False)
    batch = SimpleNamespace(forward_mode=mode, extend_num_tokens=0, split_index=0)
    try:
        Scheduler.run_batch(SchedulerStandIn(), batch)
    except _StopAfterGate:
        return True
    return False


def gate_paths(rank: int, world_size: int) -> dict:
    """start_loading publishes the exchange's finish event; set_consumer and
    run_batch wait on the last one."""
    import sglang.srt.utils as sglang_utils

    from harness.stacks.dsa_hicache_stack import build_dsa_stack

    stack = build_dsa_stack(rank, world_size, layer_num=4, skip_topk_layers=None)
    cc, alloc = stack.controller, stack.allocator
    cc.load_fence_stream = torch.cpu.current_stream()
    gate = cc.rank_shard.gate
    # One gate: the controller's accessor (what the scheduler reads) and the
    # layer counter the hybrid controller rebuilt both hand out the context's.
    one_gate = (
        cc.rank_shard_gate is gate and cc.layer_done_counter.rank_shard_gate is gate
    )
    waits: list = []
    sglang_utils.get_device_module = lambda: SimpleNamespace(
        current_stream=lambda: _RecordingStream("current", waits)
    )
    dev = alloc.alloc(2 * stack.page_size)
    host = cc.write(dev, node_id=1, extra_pools=_extra())
    alloc.free(dev)
    d1 = cc.load(host, node_id=1, extra_pools=_extra())
    cc.start_loading()
    first = gate.event
    is_last = first is cc.ack_load_queue[-1].finish_event
    alloc.free(d1)
    cc.load(host, node_id=1, extra_pools=_extra())
    cc.start_loading()
    second = gate.event
    replaced = second is cc.ack_load_queue[-1].finish_event and second is not first

    waits.clear()
    cc.layer_done_counter.set_consumer(0)
    set_consumer_waited = [event for _, event in waits]
    waits.clear()
    stopped_overlap = _run_batch_until_gate(gate, overlap=True, waits=waits)
    overlap_waited = list(waits)
    waits.clear()
    stopped_plain = _run_batch_until_gate(gate, overlap=False, waits=waits)
    return dict(
        one_gate=one_gate,
        gate_is_last_ack_finish=is_last,
        gate_replaced_by_second_load=replaced,
        last_event_id=id(second),
        set_consumer_waited=set_consumer_waited,
        run_batch_overlap_waited=overlap_waited,
        run_batch_plain_waited=list(waits),
        run_batch_stopped_after_gate=stopped_overlap and stopped_plain,
    )


# ------------------------------------------------- load-back agreement (radix)
def radix_tree_state(cache) -> list:
    """Every node of ``cache``'s (Python) radix tree, depth first in key
    order: its token path, whether its KV is on the device and how many rows
    (which rows is the rank's own allocator's business: a rank that allocated
    and freed them again for a load-back the group refused hands out others
    next), and whether it is on host and which slots (a sharded page must be
    the same host slots on every rank). Replicated TP ranks that took the
    same decisions hold identical trees: equal lists, rank for rank."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    core = cache.tree_core
    if not hasattr(core, "root_node"):
        raise AssertionError("radix_tree_state reads the Python tree core only")

    def rows(value):
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return value.tolist()
        return list(value)

    def count(value):
        return None if value is None else len(rows(value))

    state, stack = [], [((), core.root_node)]
    while stack:
        path, node = stack.pop()
        full = node.component(ComponentType.FULL)
        state.append(
            (
                path,
                node.evicted,
                count(full.value) if node.parent is not None else None,
                rows(full.host_value),
            )
        )
        for child in sorted(
            node.children.values(), key=lambda n: tuple(n.key.token_ids)
        ):
            stack.append((path + tuple(child.key.token_ids), child))
    return state


def core_digest(cache) -> int:
    """The agreement's own digest of a tree core that does not expose its
    nodes (the Rust core): equal on ranks whose trees are alike."""
    from sglang.srt.mem_cache.hicache_rank_shard.load_back import tree_digest

    return tree_digest(cache)


def _wait_written_through(cache, polls: int = 500) -> None:
    """Polls until no write-through is in flight (retired by MIN-reduced
    counts, so every rank leaves at the same poll)."""
    import time

    for _ in range(polls):
        cache.check_hicache_events()
        if not cache.ongoing_write_through:
            return
        time.sleep(0.01)
    raise AssertionError("write-through still in flight")


def group_parted(exc: BaseException) -> str | None:
    """The shard group's own report that its ranks parted (a vote or
    broadcast a peer did not join within the bounded wait, or votes or tree
    digests that differ), as ``"<type>: <text>"``; None for any other
    exception, which stays an error of the rank."""
    from sglang.srt.mem_cache.hicache_rank_shard.agreement import RankShardDivergence

    bounded = "(SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S)" in str(exc)
    if isinstance(exc, RankShardDivergence) or (
        isinstance(exc, RuntimeError) and bounded
    ):
        return f"{type(exc).__name__}: {exc}"
    return None


def load_back_agreement(
    rank: int,
    world_size: int,
    *,
    refuse_rank: int | None = 1,
    prefixes: int = 3,
    tokens: int = 64,
    refuser_evicts: bool = True,
    tree_core: str = "python",
) -> dict:
    """Load-backs through the real ``UnifiedRadixCache`` of a TP group whose
    ranks disagree on one of them.

    ``prefixes`` prefixes are cached, written through to host and evicted from
    the device on every rank; each is then loaded back (``load_back`` on its
    host node, then ``ready_to_load_host_cache`` as the scheduler does), one at
    a time. For the second, ``refuse_rank``'s device pool reads as full (its
    available size 0 however much it evicts), as a rank with a smaller pool
    would (``refuse_rank=None``: nothing patched, for the test-only variables
    SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_*). Returns, per load-back,
    whether this rank loaded it, and whether the device rows it holds
    afterwards equal the cached rows bit for bit; the radix tree afterwards
    (``radix_tree_state``) and the loads still queued. ``refuser_evicts=False``
    makes the refusing rank's eviction a no-op too: its tree parts from its
    peers' there, as a rank evicting alone would leave it. ``tree_core``:
    the radix tree core (``rust``: the servers' default, which does not
    expose its nodes: its tree is returned as the agreement's digest)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from harness.stacks.decode_hicache_stack import build_decode_stack, random_tokens

    stack = build_decode_stack(
        rank,
        world_size,
        layer_num=2,
        server_args_overrides=dict(
            disaggregation_mode="null",
            disaggregation_decode_enable_radix_cache=False,
        ),
        tree_core=tree_core,
    )
    cache = stack.cache
    shard = cache.cache_controller.rank_shard
    # The scheduler sets the load fence on every HiCache controller.
    cache.cache_controller.load_fence_stream = torch.cpu.current_stream()
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    seqs = [random_tokens(rng, tokens) for _ in range(prefixes)]
    cached = [stack.cache_prefix(s, gen) for s in seqs]
    _wait_written_through(cache)
    evicted = stack.evict_device(tokens * prefixes)
    loads = []
    for i, seq in enumerate(seqs):
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq))))
        refuse = i == 1 and rank == refuse_rank
        if refuse:  # this rank's device pool reads as full, eviction or not
            full, evict = cache._component_available_size, cache.evict_for_alloc
            cache._component_available_size = lambda component: 0
            if not refuser_evicts:
                cache.evict_for_alloc = lambda params: None
        try:
            try:
                loaded = cache.load_back(match.best_match_node)
            finally:
                if refuse:
                    cache._component_available_size = full
                    cache.evict_for_alloc = evict
            cache.ready_to_load_host_cache()
            cache.loading_check()
        except RuntimeError as e:
            parted = group_parted(e)
            if parted is None:
                raise
            # the group's report is the result: the test's check judges it
            return dict(rank=rank, sglang=sglang_identity(), parted=parted)
        after = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq))))
        exact = None
        if after.device_prefix_len == len(seq):
            rows = stack.device_rows(cache.path_device_indices(after.last_device_node))
            exact = all(torch.equal(a, b) for a, b in zip(rows, cached[i]["rows"]))
        loads.append(
            dict(
                loaded=bool(loaded),
                host_hit=int(match.host_hit_length),
                device_after=int(after.device_prefix_len),
                exact=exact,
            )
        )
    agreement = shard.agreement if shard is not None else None
    return dict(
        rank=rank,
        sglang=sglang_identity(),
        parted=None,
        sharded=shard is not None,
        evicted=evicted,
        loads=loads,
        tree=radix_tree_state(cache) if tree_core == "python" else core_digest(cache),
        queued=len(cache.cache_controller.load_queue),
        split=agreement.num_split if agreement else None,
        tokens_missed=agreement.tokens_missed if agreement else None,
        bytes_received=shard.exchange.bytes_received if shard else 0,
    )


def exchange_without_peer(rank: int, world_size: int, *, loader: int = 0) -> dict:
    """Only ``loader`` submits a sharded load-back (straight to the
    controller, past the radix cache's agreement); its peers never join the
    exchange. The loader's broadcast must fail within
    SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S, naming the layer and ranks.
    Returns the error text (None where no error) and the seconds it took."""
    import time

    from harness.stacks.dsa_hicache_stack import build_dsa_stack

    stack = build_dsa_stack(rank, world_size, model="mla", layer_num=2)
    cc = stack.controller
    cc.load_fence_stream = torch.cpu.current_stream()
    gen = torch.Generator().manual_seed(3)
    dev = stack.allocator.alloc(stack.page_size)
    node = write_random_node(
        stack.device_pool, cc, dev, node_id=1, live_ix=[], gen=gen, extra_pools=None
    )
    out = dict(rank=rank, sharded=cc.rank_shard is not None, error=None, seconds=None)
    if rank == loader:
        start = time.monotonic()
        try:
            cc.load(node["host"], node_id=1)
            cc.start_loading()
        except RuntimeError as e:
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - start
    # The peers stay alive (in a barrier of the world group) until the loader
    # is done: its broadcast times out rather than seeing them exit.
    torch.distributed.barrier()
    return out


def _agreement(rank: int, world_size: int):
    """The shard group's ``LoadBackAgreement`` of a rank-sharded plain MLA
    controller (2 layers)."""
    from harness.stacks.dsa_hicache_stack import build_dsa_stack

    stack = build_dsa_stack(rank, world_size, model="mla", layer_num=2)
    shard = stack.controller.rank_shard
    if shard is None:
        raise AssertionError("the controller's host tier is not rank-sharded")
    return shard.agreement


def mismatched_votes(rank: int, world_size: int) -> dict:
    """Rank 0 votes on a load-back while rank 1 votes on a decode restore
    (one rank took a path its peer did not). Every rank must raise, naming
    each rank's vote, instead of pairing the two collectives. Returns the
    error text and the seconds it took."""
    import time

    from sglang.srt.mem_cache.hicache_rank_shard.agreement import GO

    agreement = _agreement(rank, world_size)
    out = dict(rank=rank, error=None, error_type=None, result=None)
    start = time.monotonic()
    try:
        if rank == 0:
            out["result"] = agreement.plan_load_back(GO, 0, 64)
        else:
            out["result"] = agreement.agree_each([True])
    except Exception as e:  # noqa: BLE001 (which error is the test's check)
        out["error"], out["error_type"] = str(e), type(e).__name__
    out["seconds"] = time.monotonic() - start
    return out


def vote_without_peer(rank: int, world_size: int, *, voter: int = 0) -> dict:
    """Only ``voter`` votes on a load-back; its peers never join. The vote
    must fail within SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S, naming the
    vote and the ranks."""
    import time

    from sglang.srt.mem_cache.hicache_rank_shard.agreement import GO

    agreement = _agreement(rank, world_size)
    out = dict(rank=rank, error=None, seconds=None)
    if rank == voter:
        start = time.monotonic()
        try:
            agreement.plan_load_back(GO, 0, 64)
        except RuntimeError as e:
            out["error"] = str(e)
        out["seconds"] = time.monotonic() - start
    # The peers stay alive (in a barrier of the world group) until the voter
    # is done: its vote times out rather than seeing them exit.
    torch.distributed.barrier()
    return out


# ------------------------------------------------ PD decode restores (queue)
def decode_restores(
    rank: int,
    world_size: int,
    *,
    refuse_rank: int = 1,
    short_promise_rank: int = 1,
    agree: bool = True,
    layer_num: int = 4,
    tokens: int = 64,
) -> dict:
    """Restores of a PD decode worker at TP=``world_size``, through the real
    ``DecodePreallocQueue`` / ``DecodeTransferQueue`` (admission, then the
    transfer queue's restore state machine) over a real ``UnifiedRadixCache``
    of plain MLA. Four prefixes are cached (the same seeded rows on every
    rank, as replicated TP ranks hold), written through to host and evicted
    from the device; then one request per prefix, one at a time:

    0. restored as planned;
    1. ``refuse_rank``'s device pool reads full during its restore (its
       load-back does not fit there);
    2. ``short_promise_rank``'s restore fails after its load-back was agreed
       and queued (that rank's request promises prefill one page more than its
       host span, so the restore's coverage check fails on that rank only);
    3. restored as planned.

    ``agree=False`` (negative control) skips the group agreement of the
    restore outcome. Returns per request its status, whether this rank's
    restored device rows equal the cached rows bit for bit and their digest,
    and the decode host pool's layers."""
    import hashlib

    from sglang.srt.mem_cache.hicache_storage import PoolName

    from harness.stacks.decode_hicache_stack import build_decode_stack, random_tokens

    stack = build_decode_stack(rank, world_size, layer_num=layer_num)
    cache = stack.cache
    cc = cache.cache_controller
    shard = cc.rank_shard
    # The scheduler sets the load fence on every HiCache controller.
    cc.load_fence_stream = torch.cpu.current_stream()
    if not agree:
        cc.agree_restores = lambda oks: oks
    kv_host = cc.mem_pool_host.get_pool(PoolName.KV)
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    seqs = [random_tokens(rng, tokens) for _ in range(4)]
    cached = [stack.cache_prefix(s, gen) for s in seqs]
    _wait_written_through(cache)
    evicted = stack.evict_device(tokens * len(seqs))
    restores = []
    for i, seq in enumerate(seqs):
        dr = stack.make_request(f"r{i}", seq + random_tokens(rng, 16))
        stack.prealloc.queue.append(dr)
        admitted, _ = stack.admit()
        pm = dr.prefix_match
        promised = dr.kv_receiver.metadata["decode_prefix_len"]
        if i == 2 and rank == short_promise_rank:
            pm.l2_host_hit_length += stack.page_size
        refuse = i == 1 and rank == refuse_rank
        if refuse:  # this rank's device pool reads as full, eviction or not
            full = cache._component_available_size
            cache._component_available_size = lambda component: 0
        try:
            for _ in range(20):
                stack.restore_tick()
                if dr.hicache_restore_status.value != "pending":
                    break
        except RuntimeError as e:
            parted = group_parted(e)
            if parted is None:
                raise
            # the group's report is the result: the test's check judges it
            return dict(rank=rank, sglang=sglang_identity(), parted=parted)
        finally:
            if refuse:
                cache._component_available_size = full
        out = dict(
            admitted=[d.req.rid for d in admitted],
            promised=promised,
            l2=pm.l2_host_hit_length,
            status=dr.hicache_restore_status.value,
            exact=None,
            digest=None,
        )
        if out["status"] == "ready":
            rows = stack.device_rows(dr.hicache_restored_kv_indices)
            out["exact"] = all(
                torch.equal(a, b) for a, b in zip(rows, cached[i]["rows"])
            )
            digest = hashlib.sha256()
            for r in rows:
                digest.update(r.view(torch.int16).numpy().tobytes())
            out["digest"] = digest.hexdigest()
            stack.finish(dr)
        else:
            stack.abort_in_transfer(dr)
        # loads still queued once this request's restore ended (a rank-sharded
        # group starts those of the restores it failed at once)
        out["queued_after"] = len(cc.load_queue)
        restores.append(out)
    # A restore that failed after its load-back was queued leaves the load
    # in the queue on a replicated tier (as upstream's does): start it.
    cache.ready_to_load_host_cache()
    cache.loading_check()
    agreement = shard.agreement if shard is not None else None
    return dict(
        rank=rank,
        sglang=sglang_identity(),
        parted=None,
        sharded=shard is not None,
        evicted=evicted,
        kv_host_layers=list(kv_host._target_layer_indices),
        kv_host_layer_num=kv_host.layer_num,
        kv_host_bytes=kv_host.kv_buffer.numel() * kv_host.kv_buffer.element_size(),
        kv_host_size=kv_host.size,
        restores=restores,
        tree=radix_tree_state(cache),
        split=agreement.num_split if agreement else None,
        restores_split=agreement.num_restores_split if agreement else None,
        bytes_received=shard.exchange.bytes_received if shard else 0,
    )


# ------------------------------------------------------- DP attention groups
def _shard_over_full_tp() -> None:
    """Negative control: the plan builds its shard group from the full TP
    group (and counts its ranks), not from the cache's attention-TP group."""
    import dataclasses

    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.mem_cache.hicache_rank_shard import plan
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    original = assembler.maybe_plan_rank_shard
    plan.rank_shard_group_size = lambda parallel: parallel.tp_size

    def full_tp(*, kvcache, params):
        params = dataclasses.replace(params, tp_cache_group=get_tp_group().cpu_group)
        return original(kvcache=kvcache, params=params)

    assembler.maybe_plan_rank_shard = full_tp


def dp_attention_load_backs(
    rank: int,
    world_size: int,
    *,
    dp_size: int = 2,
    layer_num: int = 4,
    loads_by_group=(3, 1),
    tokens: int = 64,
    shard_over_full_tp: bool = False,
    cache_over_full_tp: bool = False,
) -> dict:
    """Rank shard under DP attention: ``world_size`` ranks at ``--tp
    world_size --dp-size dp_size --enable-dp-attention``, with the process
    groups a scheduler creates and a real ``UnifiedRadixCache`` on each rank
    given the group a scheduler gives it (its attention-TP group).

    Each DP group caches prefixes of its own (its own tokens and KV rows, as
    DP groups serve different requests), writes them through to host and
    evicts them from the device. Then, step by step, DP group ``g`` loads
    one back (``load_back`` + ``ready_to_load_host_cache``, the agreement
    and the exchange included) while ``step < loads_by_group[g]``, and idles
    otherwise; every step ends with an all-reduce over the full TP group, as
    each DP-attention iteration does (an idle group joins it with an idle
    batch). After each load-back the rank compares its device rows with the
    cached rows bit for bit. ``shard_over_full_tp`` (negative control): the
    shard group is the full TP group. ``cache_over_full_tp``: the cache is
    given the full TP group (a scheduler handing it ``get_tp_group()``)."""
    from array import array

    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.runtime_context import get_parallel

    from harness.stacks.decode_hicache_stack import build_decode_stack, random_tokens

    if shard_over_full_tp:
        _shard_over_full_tp()
    if cache_over_full_tp:
        from sglang.srt.distributed.parallel_state import get_tp_group
        from sglang.srt.layers import dp_attention

        dp_attention.get_dp_tp_group = get_tp_group
    stack = build_decode_stack(
        rank,
        world_size,
        layer_num=layer_num,
        server_args_overrides=dict(
            disaggregation_mode="null",
            disaggregation_decode_enable_radix_cache=False,
            dp_size=dp_size,
            enable_dp_attention=True,
        ),
        scheduler_groups=True,
    )
    parallel = get_parallel()
    group = parallel.attn_dp_rank
    cache = stack.cache
    shard = cache.cache_controller.rank_shard
    cache.cache_controller.load_fence_stream = torch.cpu.current_stream()
    tp_cpu_group = get_tp_group().cpu_group
    # Each DP group its own requests: its own tokens and rows.
    rng = random.Random(100 + group)
    gen = torch.Generator().manual_seed(100 + group)
    steps = max(loads_by_group)
    seqs = [random_tokens(rng, tokens) for _ in range(steps)]
    cached = [stack.cache_prefix(s, gen) for s in seqs]
    _wait_written_through(cache)
    evicted = stack.evict_device(tokens * steps)
    broadcasts = _count_calls(dist, "broadcast")  # the exchange's, from here on
    loads, per_step = [], []
    for step in range(steps):
        before = len(broadcasts)
        if step < loads_by_group[group]:
            seq = seqs[step]
            key = RadixKey(array("q", seq))
            match = cache.match_prefix(MatchPrefixParams(key=key))
            loaded = cache.load_back(match.best_match_node)
            cache.ready_to_load_host_cache()
            cache.loading_check()
            after = cache.match_prefix(MatchPrefixParams(key=key))
            exact = None
            if after.device_prefix_len == len(seq):
                rows = stack.device_rows(
                    cache.path_device_indices(after.last_device_node)
                )
                exact = all(
                    torch.equal(a, b) for a, b in zip(rows, cached[step]["rows"])
                )
            loads.append(
                dict(
                    loaded=bool(loaded),
                    host_hit=int(match.host_hit_length),
                    device_after=int(after.device_prefix_len),
                    exact=exact,
                )
            )
        per_step.append(len(broadcasts) - before)
        # The iteration's collective over every rank of the TP group.
        dist.all_reduce(torch.zeros(1), group=tp_cpu_group)
        if loads and not loads[-1]["exact"]:
            break  # wrong rows: a broken shard group; stop before it hangs
    plan = shard.plan if shard is not None else None
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv_host = cache.cache_controller.mem_pool_host.get_pool(PoolName.KV)
    return dict(
        rank=rank,
        sglang=sglang_identity(),
        attn_dp_rank=group,
        attn_tp=(parallel.attn_tp_rank, parallel.attn_tp_size),
        sharded=shard is not None,
        shard_rank=plan.rank if plan else None,
        shard_size=plan.tp_size if plan else None,
        group_ranks=list(plan.group_ranks) if plan else None,
        kv_host_layers=list(kv_host._target_layer_indices),
        kv_host_size=kv_host.size,
        row_bytes=stack.pool.kv_buffer[0][0].numel()
        * stack.pool.kv_buffer[0].element_size(),
        evicted=evicted,
        loads=loads,
        broadcasts_per_step=per_step,
        decisions=shard.agreement.num_decisions if shard else None,
        bytes_sent=shard.exchange.bytes_sent if shard else 0,
        bytes_received=shard.exchange.bytes_received if shard else 0,
        **_wire_bytes(broadcasts, dist.get_rank()),
    )


def inactive_reasons_by_pool(
    rank: int, world_size: int, *, tp_size: int, pools, **overrides
) -> list:
    """The activation check's reasons for a freshly published ServerArgs, for
    each DSA pool of ``pools`` ((KV layers, live indexer layers) each)."""
    from sglang.srt.mem_cache.hicache_rank_shard.config import (
        rank_shard_inactive_reasons,
    )

    from harness.stacks.dsa_hicache_stack import dsa_device_pool, publish_server_args

    publish_server_args(rank, tp_size, **overrides)
    out = []
    for kv, live in pools:
        skip = [i >= live for i in range(kv)]
        out.append(
            rank_shard_inactive_reasons(
                dsa_device_pool(layer_num=kv, skip_topk_layers=skip)
            )
        )
    return out


# ------------------------------------------------------------- L3 shards (file)
def _shard_files(storage_dir: str) -> dict:
    """The shard objects in the storage directory: file name -> size."""
    import os

    return {
        name: os.path.getsize(os.path.join(storage_dir, name))
        for name in sorted(os.listdir(storage_dir))
        if name.endswith(".bin")
    }


def l3_shards(
    rank: int,
    world_size: int,
    *,
    storage_dir: str,
    model: str = "dsa",
    layer_num: int = 5,
    num_pages: int = 4,
    delete_rank: int = 1,
    delete_page: int = 2,
    variant: str | None = None,
) -> dict:
    """A TP group's L3 (``file`` backend) through its real controller: the
    rank-sharded DSA (or plain MLA) stack writes ``num_pages`` host pages to
    storage (``write_storage``, the backup thread), prefetches them back into
    fresh host slots (``prefetch``: the hit query and its MIN all-reduce in
    the prefetch thread; then ``_page_transfer``, the L3 -> L2 read), then
    rank 0 deletes ``delete_rank``'s KV shard file of page ``delete_page``
    and every rank prefetches again. Returns what each rank wrote, read and
    hit, and whether the pages it read back equal what it wrote.

    Negative controls (``variant``): ``same_key`` gives every rank rank 0's
    key; ``double_count`` counts each written object twice; ``local_hits``
    skips the group's MIN of the hit query."""
    import os

    import torch.distributed as dist
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_rank_shard.storage import (
        RankShardStorage,
        shard_key_suffix,
    )
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolName
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from harness.stacks.dsa_hicache_stack import build_dsa_stack

    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = storage_dir
    skip = (True,) * layer_num if model == "mla" else (False, False, True, False, False)
    stack = build_dsa_stack(
        rank,
        world_size,
        model=model,
        layer_num=layer_num,
        skip_topk_layers=skip,
    )
    cc, pool, ps = stack.controller, stack.device_pool, stack.page_size
    # as UnifiedRadixCache's storage attachment does at startup
    cc.attach_storage_backend(
        storage_backend="file",
        model_name="tiny",
        host_pools=cc.mem_pool_host.entries,
    )
    shard, backend = cc.rank_shard, cc.storage_backend
    if variant == "same_key":
        backend.config_suffix = backend.config_suffix.replace(
            shard.l3.key_suffix, shard_key_suffix(world_size, 0)
        )
    elif variant == "double_count":
        once = shard.l3.count_written
        shard.l3.count_written = lambda n: (once(n), once(n))
    elif variant == "local_hits":
        cc._sync_prefetch_hit_query = lambda operation, count: count
    host_pools = {PoolName.KV: stack.kv_host}
    if stack.indexer_host is not None:
        host_pools[PoolName.INDEXER] = stack.indexer_host

    gen = torch.Generator().manual_seed(3)
    dev = stack.allocator.alloc(ps * num_pages)
    live_ix = [i for i, s in enumerate(skip) if not s]
    node = write_random_node(
        pool, cc, dev, node_id=1, live_ix=live_ix, gen=gen, extra_pools=_extra(model)
    )
    host = node["host"]
    written = {
        name: [
            p.get_data_page(host[i * ps], flat=True).clone() for i in range(num_pages)
        ]
        for name, p in host_pools.items()
    }
    tokens = list(range(11, 11 + ps * num_pages))
    hashes = get_storage_hash_str(tokens, None, page_size=ps)
    cc.write_storage(host, tokens, hash_value=hashes, extra_pools=_extra(model))
    cc.ack_backup_queue.get(timeout=120)
    dist.barrier()
    files_after_write = _shard_files(storage_dir)
    bytes_written = shard.l3.bytes_written

    def prefetch(rid: str) -> dict:
        before = shard.l3.bytes_read
        cc.prefetch(CacheRequestHandle(rid, 0), tokens, extra_pools=_extra(model))
        op = cc.prefetch_hit_queue.get(timeout=120)
        hit = int(op.storage_hit_count)
        same = None
        if hit:
            slots = stack.kv_host.alloc(hit)
            op.host_indices = slots
            cc._page_transfer(op)
            same = all(
                torch.equal(p.get_data_page(slots[i * ps], flat=True), written[n][i])
                for n, p in host_pools.items()
                for i in range(hit // ps)
            )
        dist.barrier()
        return dict(hit=hit, same=same, bytes_read=shard.l3.bytes_read - before)

    first = prefetch("all-shards")
    if rank == 0:
        doomed = [
            name
            for name in files_after_write
            if name.startswith(hashes[delete_page] + "_")
            and name.endswith(shard_key_suffix(world_size, delete_rank) + ".bin")
        ]
        for name in doomed:
            os.remove(os.path.join(storage_dir, name))
    dist.barrier()
    second = prefetch("one-shard-missing")

    def lookup(rank_shard) -> int:
        """The pages of the first request another server's identity finds."""
        config = backend_config(rank_shard)
        return HiCacheFile(config).batch_exists(hashes)

    def backend_config(rank_shard):
        from dataclasses import replace

        return replace(cc.storage_config, rank_shard=rank_shard)

    others = dict(
        own=lookup(RankShardStorage(tp_size=world_size, rank=rank)),
        other_tp=lookup(RankShardStorage(tp_size=2 * world_size, rank=rank)),
        other_rule=lookup(
            RankShardStorage(tp_size=world_size, rank=rank, rule="contiguous")
        ),
        replicated=lookup(None),
    )
    return dict(
        rank=rank,
        sglang=sglang_identity(),
        sharded=shard is not None,
        key_suffix=shard.l3.key_suffix,
        kv_host_layers=list(stack.kv_host._target_layer_indices),
        indexer_host_layers=(
            list(stack.indexer_host._live_target_layers) if stack.indexer_host else []
        ),
        files=files_after_write,
        hashes=hashes,
        bytes_written=bytes_written,
        first=first,
        second=second,
        deleted=delete_page,
        others=others,
    )
