"""NCCL broadcast bandwidth between the GPUs of one host, and the transport used.

The rank-shard exchange assumes NVLink-rate broadcasts (~300 GB/s on NV18); a
host whose NCCL falls back to shared host memory broadcasts at PCIe rates and
the exchange then competes with the H2D copies. Prints P2P access, the layer
broadcast time for DSA-shaped layers (78.8 MB = 100K tokens x 788 B) and GB/s.

    NCCL_DEBUG=INFO python -m benchmark.hicache_rank_shard.probes.nccl_bcast_probe
"""

import os

import torch


def probe(rank, world, nbytes, iters):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dist.broadcast(buf, src=0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True
    )
    start.record()
    for i in range(iters):
        dist.broadcast(buf, src=i % world)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    return dict(
        rank=rank,
        peer_access=[
            torch.cuda.can_device_access_peer(rank, p)
            for p in range(world)
            if p != rank
        ],
        layer_ms=ms,
        gbps=nbytes / ms / 1e6,
    )


if __name__ == "__main__":
    from harness.gloo_ranks import run_ranks

    world = torch.cuda.device_count()
    res = run_ranks(probe, world, 100_000 * 788, 61, backend="nccl", timeout=180)
    for r in res:
        print(r)
    print(
        "NCCL_P2P_DISABLE",
        os.environ.get("NCCL_P2P_DISABLE"),
        "NCCL_SHM_DISABLE",
        os.environ.get("NCCL_SHM_DISABLE"),
    )
