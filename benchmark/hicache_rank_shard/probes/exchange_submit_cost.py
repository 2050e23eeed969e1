"""Host (CPU) time the rank-shard exchange takes to submit one layer, on CPU.

The sharded load-back issues, per layer, the owned host copy and the
exchange; when the host cannot issue a layer faster than the GPU runs it, the
load-back is CPU-bound (see docs/benchmarks.md, rank-shard GPU table). This probe times
``RankShardExchange.exchange_layer`` over the 61 layers of one submission for
two pools (KV and indexer, TP2, both ranks' roles) with
``torch.distributed.broadcast`` counted instead of run and one-byte rows on
the CPU: the gathers and scatters are dispatched (as a CUDA launch would be)
but move almost no data, and a layer's rows fit the 128 MB staging (one
broadcast per layer owner). It measures the exchange's own Python and dispatch
cost, not NCCL's or the copies'. ``--device cuda --dsa-rows`` runs it on a GPU
with DeepSeek-V3.2 rows (real gather and scatter launches on the exchange's
side stream). Run it with two installed wheels to compare them:

    python -m benchmark.hicache_rank_shard.probes.exchange_submit_cost
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from benchmark.bench_meta import gpu_names, run_metadata


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--submissions", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dsa-rows",
        action="store_true",
        help="DeepSeek-V3.2 rows (656 B KV, 8448 B indexer page) instead of 1 B",
    )
    ap.add_argument("--out")
    a = ap.parse_args()
    dev_kw = dict(dtype=torch.uint8, device=a.device)
    kv_row, ix_row = (656, 8448) if a.dsa_rows else (1, 1)

    import torch.distributed as dist
    from sglang.srt.mem_cache.hicache_rank_shard.config import layer_owners
    from sglang.srt.mem_cache.hicache_rank_shard.exchange import RankShardExchange
    from sglang.srt.mem_cache.l2_transfer import L2Transfer

    calls = []
    dist.broadcast = lambda tensor, src, group=None: calls.append(tensor.numel())
    ps, pages = 64, a.tokens // 64
    kv_dev = SimpleNamespace(
        kv_buffer=[
            torch.zeros(a.tokens + 4096, kv_row, **dev_kw) for _ in range(a.layers)
        ]
    )
    ix_dev = SimpleNamespace(
        index_k_with_scale_buffer=[
            torch.zeros(pages + 64, ix_row, **dev_kw) for _ in range(a.layers)
        ]
    )
    kv_host, ix_host = SimpleNamespace(page_size=ps), SimpleNamespace(page_size=ps)
    host = torch.arange(a.tokens, dtype=torch.int64)
    dev = torch.arange(4096, 4096 + a.tokens, dtype=torch.int64, device=a.device)
    results = {}

    def identity(layer):
        return layer

    for rank in range(a.tp):
        owners = layer_owners(range(a.layers), a.tp)
        ex = RankShardExchange(
            rank=rank,
            group_ranks=range(a.tp),
            group=None,
            kv_host=kv_host,
            indexer_host=ix_host,
            kv_owner=owners,
            indexer_owner=owners,
            staging_bytes=128 << 20,
            device=a.device,
        )
        per_layer = []
        for _ in range(a.submissions):
            # A new list per submission, as L2TransferEngine._prepare_transfers
            # (the layer mapper is the pool entry's: the same function each time).
            transfers = [
                L2Transfer(kv_host, kv_dev, host, dev),
                L2Transfer(ix_host, ix_dev, host, dev, layer_mapper=identity),
            ]
            t0 = time.perf_counter()
            for layer in range(a.layers):
                ex.exchange_layer(layer, transfers, lambda l: None)
            ex.join()
            per_layer.append((time.perf_counter() - t0) / a.layers * 1e6)
            if a.device != "cpu":
                torch.cuda.synchronize()  # the next submission starts idle
        results[rank] = statistics.median(per_layer[3:])
    n = len(calls) / a.tp / a.submissions / a.layers
    print(
        f"{a.layers} layers, tp {a.tp}, {a.device}: "
        f"{n:.2f} broadcasts per layer; host us per layer (median): "
        + ", ".join(f"rank {r} {us:.1f}" for r, us in results.items())
    )
    if a.out:
        record = dict(
            **run_metadata(),
            **{k: v for k, v in vars(a).items() if k != "out"},
            gpus=gpu_names(a.device),
            broadcasts_per_layer=n,
            host_us_per_layer=results,
        )
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
