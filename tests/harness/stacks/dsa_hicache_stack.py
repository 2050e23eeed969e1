"""A DSA (or plain MLA) HiCache stack built on CPU through upstream's own
construction path.

``build_dsa_stack`` publishes ``ServerArgs`` for this rank, creates a
``DSATokenToKVPool`` (MLA latent KV + DSA indexer-K) and a paged allocator,
and calls ``_DsaStrategy().build`` -- the call ``attach_hybrid_pool_to_unified_cache``
makes in a server -- which runs ``prepare_host_pool_config`` ->
``build_host_pool_group`` -> ``HybridCacheController``.  With ``model="mla"``
it creates a plain ``MLATokenToKVPool`` (DeepSeek-V3 / R1, Kimi-K2) and calls
``_PlainKvStrategy().build`` instead (``build_kv_only_stack``).  Only the
CUDA-only pieces are replaced, by the stand-ins in ``tests/standins`` (the two
direct ``kvcacheio`` ops and pinned-memory registration).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

UPSTREAM_TEST_MODULE = "sglang.test.dsa_hicache_stack"


@dataclass
class DsaStack:
    server_args: Any
    device_pool: Any
    allocator: Any
    controller: Any
    build_result: Any
    layer_num: int
    page_size: int

    @property
    def kv_host(self):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        return self.controller.mem_pool_host.get_pool(PoolName.KV)

    @property
    def indexer_host(self):
        """The DSA indexer host pool (None for a plain MLA stack)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName

        entry = self.controller.mem_pool_host.entry_map.get(PoolName.INDEXER)
        return entry.host_pool if entry is not None else None

    def buffer_names(self) -> dict[int, str]:
        """data_ptr -> stable name, to make transfer traces comparable across runs."""
        names = {}
        for l, buf in enumerate(self.device_pool.kv_buffer):
            names[buf.data_ptr()] = f"device.kv[{l}]"
        for l, buf in enumerate(
            getattr(self.device_pool, "index_k_with_scale_buffer", ())
        ):
            names[buf.data_ptr()] = f"device.indexer[{l}]"
        names[self.kv_host.kv_buffer.data_ptr()] = "host.kv"
        if self.indexer_host is not None:
            names[self.indexer_host.index_k_with_scale_buffer.data_ptr()] = (
                "host.indexer"
            )
        return names


def publish_server_args(rank: int, world_size: int, **overrides):
    from sglang.srt.runtime_context import SpawnRanks
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    kwargs = dict(
        model_path="dummy",
        device="cpu",
        enable_hierarchical_cache=True,
        hicache_io_backend="direct",
        hicache_mem_layout="page_first_direct",
        hicache_ratio=2.0,
        tp_size=world_size,
    )
    kwargs.update(overrides)
    server_args = ServerArgs(**kwargs)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    return server_args


def init_scheduler_groups(server_args, rank: int, world_size: int):
    """The process groups a scheduler creates (``bootstrap._init_parallel_groups``:
    the world group over the gloo group the rank already joined, the model
    parallel groups at the published widths, the DP-attention placement).
    Returns the group ``kv_cache_builder`` hands the cache as
    ``tp_cache_group``: ``get_dp_tp_group()``, the attention-TP group under
    DP attention."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.layers.dp_attention import get_dp_tp_group, initialize_dp_attention

    init_distributed_environment(
        backend="gloo", world_size=world_size, rank=rank, local_rank=rank
    )
    initialize_model_parallel()
    initialize_dp_attention(server_args=server_args)
    return get_dp_tp_group().cpu_group


def dsa_device_pool(
    *,
    size: int = 256,
    page_size: int = 64,
    layer_num: int = 4,
    skip_topk_layers=None,
    kv_dtype: torch.dtype = torch.bfloat16,
    kv_cache_dim: int = 576,
    device: str = "cpu",
):
    """A real ``DSATokenToKVPool`` (512-dim latent + 64 rope, 128-dim index-K)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=size,
        page_size=page_size,
        kv_lora_rank=512,
        dtype=kv_dtype,
        qk_rope_head_dim=64,
        layer_num=layer_num,
        device=device,
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_cache_dim,
        skip_topk_layers=list(skip_topk_layers) if skip_topk_layers else None,
    )


def mla_device_pool(
    *,
    size: int = 256,
    page_size: int = 64,
    layer_num: int = 4,
    kv_dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
):
    """A real plain ``MLATokenToKVPool`` (512-dim latent + 64 rope)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=kv_dtype,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        layer_num=layer_num,
        device=device,
        enable_memory_saver=False,
    )


def build_dsa_stack(
    rank: int = 0,
    world_size: int = 1,
    *,
    model: str = "dsa",
    layer_num: int = 5,
    skip_topk_layers: tuple[bool, ...] | None = (False, False, True, False, False),
    size: int = 1024,
    page_size: int = 64,
    kv_dtype: torch.dtype = torch.bfloat16,
    kv_cache_dim: int = 576,
    device: str = "cpu",
    tp_group=None,
    server_args_overrides: dict | None = None,
) -> DsaStack:
    """On ``device="cpu"`` the CPU stand-ins are installed; on CUDA the real
    pinned registration runs and the kvcacheio ops come from ``sgl_kernel``."""
    import torch.distributed as dist

    overrides = dict(server_args_overrides or {})
    if device != "cpu":
        overrides.setdefault("device", "cuda")
    server_args = publish_server_args(rank, world_size, **overrides)
    if device == "cpu":
        from standins import cpu_kvcacheio_standin as kvcacheio
        from standins import cpu_pinned_memory_standin as pinned_memory

        kvcacheio.install()
        pinned_memory.install()

    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _DsaStrategy,
        _PlainKvStrategy,
    )

    if model == "mla":
        pool = mla_device_pool(
            size=size,
            page_size=page_size,
            layer_num=layer_num,
            kv_dtype=kv_dtype,
            device=device,
        )
        strategy = _PlainKvStrategy()
    else:
        pool = dsa_device_pool(
            size=size,
            page_size=page_size,
            layer_num=layer_num,
            skip_topk_layers=skip_topk_layers,
            kv_dtype=kv_dtype,
            kv_cache_dim=kv_cache_dim,
            device=device,
        )
        strategy = _DsaStrategy()
    allocator = PagedTokenToKVPoolAllocator(
        size, page_size, torch.int64, device, pool, False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        tp_cache_group=tp_group if tp_group is not None else dist.group.WORLD,
    )
    result = strategy.build(
        cache=None,
        kvcache=pool,
        params=params,
        server_args=server_args,
        load_cache_event=threading.Event(),
    )
    return DsaStack(
        server_args=server_args,
        device_pool=pool,
        allocator=allocator,
        controller=result.cache_controller,
        build_result=result,
        layer_num=layer_num,
        page_size=page_size,
    )
