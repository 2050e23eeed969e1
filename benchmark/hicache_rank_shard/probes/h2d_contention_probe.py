"""Does NVLink / HBM traffic on a GPU slow a concurrent host-to-device copy?

No NCCL, no sglang: one process, two GPUs. Times the H2D copy of
``--layers`` chunks of ``--layer-mb`` MB from pinned host memory into GPU 0
(CUDA events on its stream), alone and while another stream on GPU 0 runs
(a) peer copies GPU 0 -> GPU 1 of the same size (what the rank-shard
broadcast's owner does), (b) peer copies GPU 1 -> GPU 0 (a receiver),
(c) device-local copies on GPU 0 (HBM traffic only), (d) row gathers and
(e) row scatters of 656-byte rows at random indices (SM kernels, what the
exchange's staging does). Prints and writes JSON with the ratios against the
copy alone.

Run on a 2-GPU host: ``python -m benchmark.hicache_rank_shard.probes.h2d_contention_probe --out probe.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from benchmark.bench_meta import run_metadata


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=31)
    ap.add_argument("--layer-mb", type=float, default=65.6)
    ap.add_argument("--peer-mb", type=float, default=78.8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="h2d_contention_probe.json")
    a = ap.parse_args()
    n = int(a.layer_mb * 1e6)
    m = int(a.peer_mb * 1e6)
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    host = torch.empty(a.layers * n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(a.layers * n, dtype=torch.uint8, device=d0)
    src0 = torch.empty(m, dtype=torch.uint8, device=d0)
    dst0 = torch.empty(m, dtype=torch.uint8, device=d0)
    buf1 = torch.empty(m, dtype=torch.uint8, device=d1)
    rows = m // 656
    table = torch.empty(4 * rows, 656, dtype=torch.uint8, device=d0)
    idx = torch.randperm(4 * rows, device=d0)[:rows]
    stage = torch.empty(rows, 656, dtype=torch.uint8, device=d0)
    h2d = torch.cuda.Stream(d0)
    side = torch.cuda.Stream(d0)

    def h2d_once():
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(h2d):
            start.record()
            for i in range(a.layers):
                dst[i * n : (i + 1) * n].copy_(
                    host[i * n : (i + 1) * n], non_blocking=True
                )
            end.record()
        return start, end

    def background(kind):
        if kind is None:
            return
        with torch.cuda.stream(side):
            for _ in range(4 * a.layers):
                if kind == "peer_out":
                    buf1.copy_(src0, non_blocking=True)
                elif kind == "peer_in":
                    src0.copy_(buf1, non_blocking=True)
                elif kind == "gather":
                    torch.index_select(table, 0, idx, out=stage)
                elif kind == "scatter":
                    table.index_copy_(0, idx, stage)
                else:
                    dst0.copy_(src0, non_blocking=True)

    results = {}
    for kind in (None, "peer_out", "peer_in", "local", "gather", "scatter"):
        times = []
        for _ in range(a.reps):
            torch.cuda.synchronize(d0)
            torch.cuda.synchronize(d1)
            background(kind)
            s, e = h2d_once()
            torch.cuda.synchronize(d0)
            torch.cuda.synchronize(d1)
            times.append(s.elapsed_time(e))
        results[kind or "alone"] = statistics.median(times[1:])
    base = results["alone"]
    gb = a.layers * n / 1e9
    out = {
        **run_metadata(),
        "args": vars(a),
        "gpus": [torch.cuda.get_device_name(i) for i in range(2)],
        "h2d_ms": results,
        "h2d_gbps": {k: gb / (v / 1e3) for k, v in results.items()},
        "ratio_vs_alone": {k: v / base for k, v in results.items()},
    }
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
