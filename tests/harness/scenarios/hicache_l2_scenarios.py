"""Scenarios run identically against unpatched upstream and the patched tree.

Each scenario is a module-level function ``fn(rank, world_size, **kwargs)`` for
``harness.gloo_ranks.run_ranks`` and returns plain data (lists, dicts, bytes) so
that two runs can be compared with ``harness.result_diff.diff_results``.
"""

from __future__ import annotations

import random

import torch

UPSTREAM_TEST_MODULE = "sglang.test.hicache_l2_scenarios"


def sglang_identity() -> dict:
    import sglang

    return {"version": sglang.__version__, "file": sglang.__file__}


def normalize_trace(trace: list[dict], names: dict[int, str]) -> list[dict]:
    out = []
    for call in trace:
        call = dict(call)
        for key in ("src", "dst"):
            call[key] = tuple(names.get(p, "other") for p in call[key])
        out.append(call)
    return out


def random_like(tensor: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if tensor.dtype == torch.uint8:
        return torch.randint(0, 256, tensor.shape, generator=gen, dtype=torch.uint8)
    return torch.randn(tensor.shape, generator=gen).to(tensor.dtype)


def write_random_node(pool, cc, dev, *, node_id, live_ix, gen, extra_pools):
    """Fill the device rows of ``dev`` (KV, and the indexer pages of the live
    layers) with fresh random data, back them up through the controller and
    return the node (host indices + reference rows), or None without host space."""
    ps = pool.page_size
    pages = dev[::ps] // ps
    layer_num = len(pool.kv_buffer)
    for l in range(layer_num):
        pool.kv_buffer[l][dev] = random_like(pool.kv_buffer[l][dev], gen)
    for l in live_ix:
        ix = pool.index_k_with_scale_buffer[l]
        ix[pages] = random_like(ix[pages], gen)
    host = cc.write(dev, node_id=node_id, extra_pools=extra_pools)
    if host is None:
        return None
    return dict(
        host=host,
        kv=[pool.kv_buffer[l][dev].clone() for l in range(layer_num)],
        ix={l: pool.index_k_with_scale_buffer[l][pages].clone() for l in live_ix},
    )


def _alter_nth_h2d(n: int) -> None:
    """Negative control: shift the destination of the n-th H2D call by one page."""
    from sglang.srt.mem_cache.pool_host import dsa, mla

    from standins import cpu_kvcacheio_standin as kvcacheio

    calls = {"count": 0}

    def altered(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
        calls["count"] += 1
        if calls["count"] == n:
            dst_indices = dst_indices + page_size
        kvcacheio.transfer_kv_per_layer_direct_pf_lf(
            src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
        )

    mla.transfer_kv_per_layer_direct_pf_lf = altered
    dsa.transfer_kv_per_layer_direct_pf_lf = altered


def l2_roundtrip(
    rank: int,
    world_size: int,
    *,
    seed: int = 0,
    steps: int = 40,
    layer_num: int = 5,
    skip_topk_layers=(False, False, True, False, False),
    alter_h2d_call: int | None = None,
) -> dict:
    """Random backups, device evictions, load-backs and host evictions through
    the real ``HybridCacheController`` and ``L2TransferEngine``; returns the
    trace of every transfer call, per-load verification and final contents."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    from harness.stacks.dsa_hicache_stack import build_dsa_stack
    from standins import cpu_kvcacheio_standin as kvcacheio

    stack = build_dsa_stack(
        rank, world_size, layer_num=layer_num, skip_topk_layers=skip_topk_layers
    )
    if alter_h2d_call is not None:
        _alter_nth_h2d(alter_h2d_call)
    pool, alloc, cc = stack.device_pool, stack.allocator, stack.controller
    ps = stack.page_size
    live_ix = [i for i, skip in enumerate(skip_topk_layers or []) if not skip] or list(
        range(layer_num)
    )

    def indexer_pages(dev):
        return dev[::ps] // ps

    def extra():
        return [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for buf in list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer):
        buf.copy_(random_like(buf, gen))

    names = stack.buffer_names()
    kvcacheio.start_trace()
    nodes: dict[int, dict] = {}
    events, next_id = [], 1
    for _ in range(steps):
        op = rng.choice(["write", "write", "load", "load", "evict_host"])
        if op == "write" or not nodes:
            dev = alloc.alloc(ps * rng.randint(1, 3))
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
            events.append(("write", next_id, host.tolist(), dev.tolist()))
            next_id += 1
            # The device copy is evicted and its rows are reused.
            alloc.free(dev)
            for l in range(layer_num):
                pool.kv_buffer[l][dev] = 0
        elif op == "load":
            node_id = rng.choice(sorted(nodes))
            node = nodes[node_id]
            dev = cc.load(node["host"], node_id=node_id, extra_pools=extra())
            if dev is None:
                events.append(("load", node_id, "no device space"))
                continue
            cc.start_loading()
            ok_kv = all(
                torch.equal(pool.kv_buffer[l][dev], node["kv"][l])
                for l in range(layer_num)
            )
            ok_ix = all(
                torch.equal(pool.index_k_with_scale_buffer[l][indexer_pages(dev)], rows)
                for l, rows in node["ix"].items()
            )
            events.append(("load", node_id, dev.tolist(), ok_kv, ok_ix))
            alloc.free(dev)
        else:
            node_id = rng.choice(sorted(nodes))
            freed = cc.evict_host(nodes.pop(node_id)["host"])
            events.append(("evict_host", node_id, int(freed)))
    trace = normalize_trace(kvcacheio.stop_trace(), names)
    return dict(
        sglang=sglang_identity(),
        events=events,
        trace=trace,
        device_kv=[
            bytes(b.contiguous().view(torch.uint8).flatten().numpy())
            for b in pool.kv_buffer
        ],
        device_indexer=[
            bytes(b.contiguous().view(torch.uint8).flatten().numpy())
            for b in pool.index_k_with_scale_buffer
        ],
        host_kv=bytes(
            stack.kv_host.kv_buffer.contiguous().view(torch.uint8).flatten().numpy()
        ),
    )
