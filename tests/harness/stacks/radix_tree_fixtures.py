"""Real ``UnifiedRadixCache`` instances on CPU for routing tests and benchmarks.

``build_tree(page_size, backend="python"|"rust", kv_size=...)`` builds a
``UnifiedRadixCache`` over a real CPU ``MHATokenToKVPool``, allocator and
``ReqToTokenPool`` with KV-cache events enabled, the way the scheduler builds
one. ``insert`` allocates KV for a token sequence and inserts it (what a
finished request does); ``evict`` frees device KV through the tree's own
eviction.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Optional

import torch

UPSTREAM_TEST_MODULE = "sglang.test.radix_tree_fixtures"


@dataclass
class Tree:
    cache: Any
    allocator: Any
    req_to_token_pool: Any
    page_size: int
    backend: str
    params: Any = None


def build_tree(
    page_size: int = 4,
    backend: str = "python",
    kv_size: int = 4096,
    lora_names: Optional[dict] = None,
    publish_server_args: bool = True,
    record_extra_keys: bool = True,
) -> Tree:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.events import KvEventLoraNames
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    if publish_server_args:
        set_global_server_args_for_scheduler(
            ServerArgs(model_path="dummy", page_size=page_size)
        )
    req_to_token_pool = ReqToTokenPool(
        size=8, max_context_len=kv_size, device="cpu", enable_memory_saver=False
    )
    kv_pool = MHATokenToKVPool(
        size=kv_size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(
        size=kv_size,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=kv_pool,
        need_sort=False,
    )
    names = KvEventLoraNames()
    for extra_key, name in (lora_names or {}).items():
        names._names[extra_key] = name
    # As the scheduler sets it when it publishes prefix digests.
    names.record_extra_keys = record_extra_keys
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_kv_cache_events=True,
        kv_event_lora_names=names,
        tree_components=(ComponentType.FULL,),
        tree_core_backend=backend,
    )
    cache = UnifiedRadixCache(params=params)
    return Tree(cache, allocator, req_to_token_pool, page_size, backend, params)


def insert(
    tree: Tree,
    tokens,
    *,
    extra_key: Optional[str] = None,
    cache_salt: Optional[str] = None,
) -> int:
    """Insert ``tokens`` (page-floored) with freshly allocated KV; returns the
    number of tokens newly stored (the rest was already cached)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    n = len(tokens) // tree.page_size * tree.page_size
    if n == 0:
        return 0
    key = RadixKey(array("q", tokens[:n]), extra_key=extra_key, cache_salt=cache_salt)
    value = tree.allocator.alloc(n)
    if value is None:
        evict(tree, n)
        value = tree.allocator.alloc(n)
        if value is None:
            raise RuntimeError("KV pool exhausted even after eviction")
    # The tree frees the part of ``value`` it already holds.
    result = tree.cache.insert(InsertParams(key=key, value=value))
    return n - result.prefix_len


def match(tree: Tree, tokens, *, extra_key=None, cache_salt=None):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return tree.cache.match_prefix(
        MatchPrefixParams(
            key=RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
        )
    )


def evict(tree: Tree, num_tokens: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    tree.cache.evict(EvictParams(num_tokens=num_tokens))


HOST_BUDGET_BYTES = 2 << 30  # the host pools one test tree may book


def enable_hicache(
    tree: Tree, write_policy: str = "write_back", **server_kwargs
) -> None:
    """Attach a real HiCache host tier (L2) to ``tree`` on CPU.

    Upstream's ``init_hicache`` builds the host pool and cache controller; only
    pinned-memory registration and the two ``page_first_direct`` copy ops are
    replaced by the CPU stand-ins of ``tests/standins``. With ``write_back``,
    device eviction backs a leaf up to host first (a GPU remove plus a host
    store), and ``cache.evict_host`` frees host copies.
    """
    import atexit

    from sglang.srt.mem_cache.pool_host import mha
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from standins import cpu_kvcacheio_standin as kvcacheio
    from standins import cpu_pinned_memory_standin as pinned_memory

    kvcacheio.install()
    pinned_memory.install()
    # The stand-ins implement the MHA (K then V buffers) layout as well.
    mha.transfer_kv_all_layer_direct_lf_pf = (
        kvcacheio.transfer_kv_all_layer_direct_lf_pf
    )
    mha.transfer_kv_per_layer_direct_pf_lf = (
        kvcacheio.transfer_kv_per_layer_direct_pf_lf
    )
    server_args = ServerArgs(
        model_path="dummy",
        page_size=tree.page_size,
        hicache_io_backend="direct",
        hicache_mem_layout="page_first_direct",
        hicache_write_policy=write_policy,
        **{"hicache_size": 1, **server_kwargs},
    )
    set_global_server_args_for_scheduler(server_args)
    # The pool is booked against a fixed allowance (upstream's own budget
    # scope), not the machine's free memory less upstream's 10 GB reserve: a
    # live lane's servers beside this test can take that, and the pool (1 GB
    # of address space, a few pages touched) is this test's alone.
    with host_memory_budget_scope(HOST_BUDGET_BYTES):
        tree.cache.init_hicache(server_args, tree.params)
    atexit.unregister(tree.cache.shutdown)
