"""The rank-shard exchange of two TP ranks in one process, on one device.

Two ``RankShardExchange`` objects (rank 0 and rank 1 of a TP2 shard group)
each hold their own copy of DSA-shaped device layers (KV rows of 656 B, indexer
pages of 8448 B); the owner's rows are random, the other rank's are zero. Each
rank runs ``exchange_layer`` over every layer in its own thread, as its
scheduler would (side stream, staging, gathers and scatters are the real
ones), and ``torch.distributed.broadcast`` is a hand-over between the two
threads (the sender's staging bytes, once its stream has them, become the
receiver's). After ``join`` every rank's layers must equal the owners' bytes
at the loaded rows and be untouched elsewhere. ``--skip`` leaves indexer layers
out so that some layers have two owners (two broadcasts); ``--staging-mb``
small makes a layer take several broadcasts. On one GPU it checks the CUDA
path of the exchange; on the CPU it runs as a smoke test.

    python -m benchmark.hicache_rank_shard.probes.exchange_loopback --device cuda
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
from types import SimpleNamespace

import torch

from benchmark.bench_meta import gpu_names, run_metadata

KV_ROW, IX_PAGE, PAGE = 656, 8448, 64


def _layers(n, rows, row_bytes, device, gen):
    return [
        torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen).to(
            device
        )
        for _ in range(n)
    ]


def run(device: str, layers: int, tokens: int, skip: tuple, staging_mb: float) -> dict:
    import torch.distributed as dist
    from sglang.srt.mem_cache.hicache_rank_shard.config import layer_owners
    from sglang.srt.mem_cache.hicache_rank_shard.exchange import RankShardExchange
    from sglang.srt.mem_cache.l2_transfer import L2Transfer

    gen = torch.Generator().manual_seed(0)
    pages = tokens // PAGE
    dev_pages = pages * 2 + 3  # loaded rows scattered in a larger pool
    live = [l for l in range(layers) if l not in skip]
    kv_owner = layer_owners(range(layers), 2)
    ix_owner = layer_owners(live, 2)
    truth_kv = _layers(layers, dev_pages * PAGE, KV_ROW, device, gen)
    truth_ix = _layers(layers, dev_pages, IX_PAGE, device, gen)
    page_ids = torch.randperm(dev_pages, generator=gen)[:pages].sort().values
    token_rows = (page_ids[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    token_rows = token_rows.to(device)
    kv_host, ix_host = SimpleNamespace(page_size=PAGE), SimpleNamespace(page_size=PAGE)
    channels = {0: queue.Queue(), 1: queue.Queue()}  # src rank -> hand-over
    ranks = []
    for rank in (0, 1):
        # What a rank holds after its own host copies: its owned layers loaded.
        kv = [torch.zeros_like(t) for t in truth_kv]
        ix = [torch.zeros_like(t) for t in truth_ix]
        for l in range(layers):
            if kv_owner[l] == rank:
                kv[l][token_rows] = truth_kv[l][token_rows]
            if l in ix_owner and ix_owner[l] == rank:
                ix[l][page_ids.to(device)] = truth_ix[l][page_ids.to(device)]
        ex = RankShardExchange(
            rank=rank,
            group_ranks=(0, 1),
            group=rank,  # the hand-over knows the caller by its group
            kv_host=kv_host,
            indexer_host=ix_host,
            kv_owner=kv_owner,
            indexer_owner=ix_owner,
            staging_bytes=int(staging_mb * (1 << 20)),
            device=device,
        )
        ranks.append(SimpleNamespace(rank=rank, kv=kv, ix=ix, ex=ex, calls=0))

    def broadcast(tensor, src, group=None):
        me = ranks[group]
        me.calls += 1
        if src == me.rank:
            if tensor.is_cuda:
                torch.cuda.current_stream().synchronize()
            channels[src].put(tensor.clone())
        else:
            tensor.copy_(channels[src].get(timeout=60))

    dist.broadcast = broadcast
    errors = []

    def rank_thread(r):
        try:
            if device != "cpu":
                torch.cuda.set_device(torch.device(device).index or 0)
            transfers = [
                L2Transfer(kv_host, SimpleNamespace(kv_buffer=r.kv), None, token_rows),
                L2Transfer(
                    ix_host,
                    SimpleNamespace(index_k_with_scale_buffer=r.ix),
                    None,
                    token_rows,
                    layer_mapper=lambda l: l if l in ix_owner else None,
                ),
            ]
            for l in range(layers):
                r.ex.exchange_layer(l, transfers)
            r.ex.join()
            if device != "cpu":
                torch.cuda.synchronize()
        except Exception as e:  # reported below, with the rank
            errors.append((r.rank, repr(e)))

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    rows_ix = page_ids.to(device)
    mismatches = []
    for r in ranks:
        for l in range(layers):
            want = torch.zeros_like(truth_kv[l])
            want[token_rows] = truth_kv[l][token_rows]
            if not torch.equal(r.kv[l], want):
                mismatches.append((r.rank, "kv", l))
            want = torch.zeros_like(truth_ix[l])
            if l in ix_owner:
                want[rows_ix] = truth_ix[l][rows_ix]
            if not torch.equal(r.ix[l], want):
                mismatches.append((r.rank, "indexer", l))
    return dict(
        device=str(device),
        layers=layers,
        tokens=tokens,
        skip=list(skip),
        staging_mb=staging_mb,
        broadcasts=[r.calls for r in ranks],
        errors=errors,
        mismatches=mismatches,
        ok=not errors and not mismatches,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out")
    a = ap.parse_args()
    cases = [
        dict(skip=(), staging_mb=128),  # one broadcast per layer
        dict(skip=(2, 5), staging_mb=128),  # some layers have two owners
        dict(skip=(2,), staging_mb=1),  # several broadcasts per layer
    ]
    results = [run(a.device, a.layers, a.tokens, **c) for c in cases]
    for r in results:
        print(
            f"skip {r['skip']!s:<7} staging {r['staging_mb']:>5} MB: broadcasts "
            f"{r['broadcasts']}, mismatches {len(r['mismatches'])}, errors "
            f"{r['errors'] or 0} -> {'ok' if r['ok'] else 'FAIL'}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                dict(**run_metadata(), gpus=gpu_names(a.device), cases=results),
                f,
                indent=1,
            )
    raise SystemExit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
