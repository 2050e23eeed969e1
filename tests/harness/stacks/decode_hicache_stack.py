"""A PD decode worker's admission path on CPU, built from upstream objects.

``build_decode_stack`` publishes decode ``ServerArgs`` for this rank and builds
a real ``UnifiedRadixCache`` (``tree_core``: the Python tree core or the Rust
one, 0.5.23's default; a silent fallback to Python is an error) over an MLA
device pool with a HiCache host tier (``init_hicache`` through upstream's
assembler, L2 transfers ``direct`` / ``page_first_direct``), a real ``ReqToTokenPool``, metadata-slot
allocator, ``DecodePreallocQueue`` and ``DecodeTransferQueue`` -- the queue
objects are made with ``object.__new__`` and given the attributes their
admission / restore methods read, since their constructors start a KV
transfer manager. Stand-ins, all under ``tests/``:

* ``KVReceiverStandIn`` -- the KV receiver (no prefill peer): reports
  ``WaitingForInput`` until told otherwise and records ``send_metadata``;
* the two ``kvcacheio`` direct ops and pinned-memory registration
  (``tests/standins``);
* ``SchedulerStandIn`` -- the scheduler attributes the queues read.

``HostLockCounter`` counts the host-lock receipts taken and returned through
the tree core (the Rust core does not expose per-node host lock refs).
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

UPSTREAM_TEST_MODULE = "sglang.test.decode_hicache_stack"


class KVReceiverStandIn:
    """Stand-in for the PD KV receiver: polls ``WaitingForInput`` (the
    handshake is done) and records the destination it is sent."""

    supports_host_destination = False

    def __init__(self):
        from sglang.srt.disaggregation.base import KVPoll

        self.state = KVPoll.WaitingForInput
        self.metadata = None
        self.aborted = False

    def poll(self):
        return self.state

    def send_metadata(self, page_indices, metadata_index, state_indices, **kwargs):
        self.metadata = dict(
            pages=[int(p) for p in page_indices],
            decode_prefix_len=kwargs.get("decode_prefix_len"),
        )

    def abort(self):
        from sglang.srt.disaggregation.base import KVPoll

        self.aborted = True
        self.state = KVPoll.Failed

    def failure_exception(self):
        raise RuntimeError("aborted (KV receiver stand-in)")

    def clear(self):
        pass


class HostLockCounter:
    """Host-lock receipts outstanding on a tree core: wraps the core's
    ``inc_host_lock_ref`` / ``dec_host_lock_ref`` (every host lock of the
    cache and the decode queues goes through them) and counts component
    host-lock UUIDs handed out minus those returned."""

    def __init__(self, core):
        self.outstanding = 0
        inc, dec = core.inc_host_lock_ref, core.dec_host_lock_ref

        def counting_inc(node_id):
            result = inc(node_id)
            self.outstanding += len(result.component_host_lock_uuids)
            return result

        def counting_dec(node_id, params):
            result = dec(node_id, params)
            self.outstanding -= len(params.component_host_lock_uuids)
            return result

        core.inc_host_lock_ref = counting_inc
        core.dec_host_lock_ref = counting_dec


class SchedulerStandIn(SimpleNamespace):
    """The scheduler attributes ``DecodePreallocQueue`` / ``DecodeTransferQueue``
    read on the admission and restore paths."""


@dataclass
class DecodeStack:
    server_args: Any
    pool: Any
    allocator: Any
    req_to_token_pool: Any
    cache: Any
    prealloc: Any
    transfer: Any
    page_size: int
    tree_core: str
    host_locks: HostLockCounter
    counters: dict = field(default_factory=dict)

    # ------------------------------------------------------------ tree setup
    def cache_prefix(self, tokens, gen: torch.Generator, required: bool = True):
        """Insert ``tokens`` as a finished request would: fresh random KV rows,
        inserted into the tree and written through to host. Returns the rows
        (None when not ``required`` and the device pool cannot hold them)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        idx = self.allocator.alloc(len(tokens))
        if idx is None:
            self.evict_device(len(tokens))
            idx = self.allocator.alloc(len(tokens))
        if idx is None and not required:
            return None
        assert idx is not None, "device pool full while caching a prefix"
        rows = [
            torch.randn(len(tokens), *buf.shape[1:], generator=gen).to(buf.dtype)
            for buf in self.pool.kv_buffer
        ]
        for buf, r in zip(self.pool.kv_buffer, rows):
            buf[idx] = r
        result = self.cache.insert(
            InsertParams(key=RadixKey(array("q", tokens)), value=idx)
        )
        if result.prefix_len:
            self.allocator.free(idx[: result.prefix_len])
        self.cache.check_hicache_events()
        return {"tokens": list(tokens), "rows": rows}

    def evict_device(self, num_tokens: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def evict_host(self, num_tokens: int) -> int:
        return self.cache.evict_host(num_tokens)

    def device_rows(self, kv_indices) -> list:
        return [buf[kv_indices].clone() for buf in self.pool.kv_buffer]

    # --------------------------------------------------------------- requests
    def make_request(self, rid: str, tokens, max_new_tokens: int = 8):
        from sglang.srt.disaggregation.decode import DecodeRequest
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid=rid,
            origin_input_text="",
            origin_input_ids=array("q", tokens),
            sampling_params=SamplingParams(
                temperature=0, max_new_tokens=max_new_tokens
            ),
        )
        return DecodeRequest(
            req=req, kv_receiver=KVReceiverStandIn(), waiting_for_input=True
        )

    def admit(self):
        """One ``pop_preallocated``; admitted requests move to the transfer
        queue as the scheduler does."""
        admitted, failed = self.prealloc.pop_preallocated()
        self.transfer.queue.extend(admitted)
        return admitted, failed

    def restore_tick(self):
        """One tick of the transfer queue's HiCache restore state machine."""
        self.transfer._process_hicache_local_restores(list(self.transfer.queue))
        self.cache.loading_check()

    def finish(self, decode_req) -> None:
        """The KV transfer landed: commit the restore and release the request
        into the tree (as a finished request)."""
        from sglang.srt.mem_cache.common import release_kv_cache

        self.transfer._commit_hicache_local_restore_to_req(decode_req)
        self.transfer.queue.remove(decode_req)
        self.prealloc.req_to_metadata_buffer_idx_allocator.free(
            decode_req.metadata_buffer_index
        )
        release_kv_cache(decode_req.req, self.cache, checkpoint=False)

    def abort_in_transfer(self, decode_req) -> None:
        """An abort while the request is in the transfer queue (failed poll):
        the transfer queue's cleanup and release path."""
        self.transfer._clean_hicache_prefetch_resources(decode_req)
        self.transfer.queue.remove(decode_req)
        self.prealloc.req_to_metadata_buffer_idx_allocator.free(
            decode_req.metadata_buffer_index
        )
        release_kv_cache_for_abort(decode_req.req, self.cache)

    # ---------------------------------------------------------------- counts
    def snapshot(self) -> dict:
        cc = self.cache.cache_controller
        return dict(
            device_available=int(self.allocator.available_size()),
            device_evictable=int(self.cache.evictable_size()),
            device_protected=int(self.cache.protected_size()),
            host_available=int(cc.mem_pool_host.available_size()),
            req_slots=int(self.req_to_token_pool.available_size()),
            metadata_slots=int(
                self.prealloc.req_to_metadata_buffer_idx_allocator.available_size()
            ),
        )


def release_kv_cache_for_abort(req, cache) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    release_kv_cache(req, cache, checkpoint=False)


def publish_decode_server_args(rank: int, world_size: int, **overrides):
    """The DSA stack's HiCache server args (``direct`` / ``page_first_direct``)
    for a PD decode worker with the decode radix cache."""
    from harness.stacks.dsa_hicache_stack import publish_server_args

    kwargs = dict(
        page_size=16,
        disaggregation_mode="decode",
        disaggregation_decode_enable_radix_cache=True,
    )
    kwargs.update(overrides)
    return publish_server_args(rank, world_size, **kwargs)


def build_decode_stack(
    rank: int = 0,
    world_size: int = 1,
    *,
    size: int = 1024,
    page_size: int = 16,
    layer_num: int = 2,
    max_reqs: int = 16,
    num_reserved_decode_tokens: int = 16,
    server_args_overrides: dict | None = None,
    tree_core: str = "python",
    scheduler_groups: bool = False,
) -> DecodeStack:
    """``scheduler_groups``: create the scheduler's process groups
    (``init_scheduler_groups``) and hand the cache the one a scheduler does
    (under DP attention the attention-TP group); else the world group."""
    import torch.distributed as dist

    from standins import cpu_kvcacheio_standin as kvcacheio
    from standins import cpu_pinned_memory_standin as pinned_memory

    overrides = dict(server_args_overrides or {})
    overrides.setdefault("page_size", page_size)
    server_args = publish_decode_server_args(rank, world_size, **overrides)
    cache_group = dist.group.WORLD
    if scheduler_groups:
        from harness.stacks.dsa_hicache_stack import init_scheduler_groups

        cache_group = init_scheduler_groups(server_args, rank, world_size)
    kvcacheio.install()
    pinned_memory.install()

    from sglang.srt.disaggregation.decode import (
        DecodePreallocQueue,
        DecodeTransferQueue,
    )
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    pool = MLATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.bfloat16,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(
        size, page_size, torch.int64, "cpu", pool, False
    )
    req_to_token_pool = ReqToTokenPool(
        size=max_reqs, max_context_len=4096, device="cpu", enable_memory_saver=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        tp_cache_group=cache_group,
        tree_core_backend=tree_core,
        tree_components=(ComponentType.FULL,),
    )
    cache = UnifiedRadixCache(params=params)
    # select_tree_core_backend falls back to Python when the Rust core cannot
    # run here; a scenario asked for one core must not run on the other.
    if cache._tree_core_backend != tree_core:
        raise RuntimeError(
            f"asked for the {tree_core!r} tree core, got {cache._tree_core_backend!r}"
        )
    host_locks = HostLockCounter(cache.tree_core)
    cache.init_hicache(server_args, params)
    # Pinned-memory stand-in, continued: the host pools allocate their L3
    # staging pages with pin_memory=True, which needs a CUDA driver.
    from sglang.srt.mem_cache.hicache_storage import PoolName

    cc = cache.cache_controller
    for host_pool in {cc.mem_pool_host.get_pool(PoolName.KV), cc.storage_host_pool}:
        if host_pool is not None:
            host_pool.pin_memory = False

    import atexit

    atexit.unregister(cache.shutdown)

    scheduler = SchedulerStandIn(
        running_batch=SimpleNamespace(reqs=[]),
        waiting_queue=[],
        last_batch=None,
        enable_priority_scheduling=False,
        enable_hisparse=False,
        enable_lora=False,
        enable_decode_hicache=True,
        tp_worker=SimpleNamespace(is_hybrid_swa=False),
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        output_streamer=SimpleNamespace(stream_output=lambda reqs, *a, **k: None),
        sliding_window_size=None,
    )
    transfer = object.__new__(DecodeTransferQueue)
    transfer.__dict__.update(
        queue=[],
        scheduler=scheduler,
        tree_cache=cache,
        gloo_group=dist.group.WORLD,
        enable_staging=False,
        tp_rank=rank,
    )
    prealloc = object.__new__(DecodePreallocQueue)
    prealloc.__dict__.update(
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        token_to_kv_pool=pool,
        draft_token_to_kv_pool=None,
        req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(max_reqs),
        scheduler=scheduler,
        transfer_queue=transfer,
        tree_cache=cache,
        gloo_group=dist.group.WORLD,
        tp_rank=rank,
        pp_rank=0,
        pp_size=1,
        num_reserved_decode_tokens=num_reserved_decode_tokens,
        queue=[],
        retracted_queue=[],
        pending_reqs=[],
        _prefill_dp_rank_queries={},
        _num_published_destinations=0,
        host_pool=None,
        host_reserved_tokens=0,
        kv_manager=SimpleNamespace(kv_args=SimpleNamespace(state_types=[])),
        transfer_backend=None,
        enable_staging=False,
        max_total_num_tokens=size,
    )
    return DecodeStack(
        server_args=server_args,
        pool=pool,
        allocator=allocator,
        req_to_token_pool=req_to_token_pool,
        cache=cache,
        prealloc=prealloc,
        transfer=transfer,
        page_size=page_size,
        tree_core=tree_core,
        host_locks=host_locks,
    )


def random_tokens(rng: random.Random, n: int, vocab: int = 50000) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]
