"""Rank-sharded HiCache host tier: bytes, capacity, exchange overhead, GPU times.

1. DeepSeek-V3.2 geometry (61 layers; FP8 latent 656 B + indexer 132 B per
   token per layer), tp 2/4/8, computed with the patched module's own owner
   map and sizing: per-rank host bytes copied for a 100K-token backup and
   load-back, bytes broadcast, unique host capacity at the same host memory
   (also with one MTP draft layer, replicated as shipped or sharded); each
   against the replicated baseline (flag off).
2. CPU (gloo, 2 processes, the real patched engine): load-back time sharded
   vs replicated vs copy-only in the same run, as ratios.
3. GPU: the JSON files of ``gpu_tp_run.py`` runs (``--gpu-results DIR``),
   sharded / replicated load-back and write-back time.

Prints a table, writes results/<run>/bench_rank_shard.json and .png.

    .venv/bin/python -m benchmark.hicache_rank_shard.bench_rank_shard [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmark.bench_meta import run_dir, run_metadata

HERE = Path(__file__).resolve().parent

LAYERS = 61
KV_ROW, IX_ROW = 656, 132
PREFIX = 100_000
HOST_GB = 200.0  # --hicache-size per rank, for the capacity comparison
MTP_LAYERS = 1  # DeepSeek-V3.2's NextN draft layer (packed into the KV host pool)
SIDECAR_ROW = MTP_LAYERS * (KV_ROW + IX_ROW)  # the same draft as a sidecar pool


def geometry_table() -> list[dict]:
    from sglang.srt.mem_cache.hicache_rank_shard.config import (
        owned_layers,
        rank_shard_host_token_capacity,
    )

    rows = []
    layers = list(range(LAYERS))
    for tp in (2, 4, 8):
        owned = max(len(owned_layers(layers, r, tp)) for r in range(tp))
        per_layer = PREFIX * (KV_ROW + IX_ROW)
        replicated = per_layer * LAYERS
        sharded = per_layer * owned
        kw = dict(
            device_capacity_tokens=1_000_000,
            page_size=64,
            hicache_ratio=0.0,
            hicache_size_gb=HOST_GB,
            bytes_per_token_layer=KV_ROW,
            layer_num=LAYERS,
            tp_size=tp,
        )
        cap_rep = rank_shard_host_token_capacity(**kw, keep_capacity=True)
        cap_shard = rank_shard_host_token_capacity(**kw)
        # One MTP (NextN) draft layer packed into the KV host pool: it stays
        # replicated (what ships), against sharding it as a 62nd layer.
        mtp_rep = rank_shard_host_token_capacity(
            **kw, draft_layer_num=MTP_LAYERS, keep_capacity=True
        )
        mtp_shipped = rank_shard_host_token_capacity(**kw, draft_layer_num=MTP_LAYERS)
        mtp_sharded = rank_shard_host_token_capacity(
            **{**kw, "layer_num": LAYERS + MTP_LAYERS}
        )
        rows.append(
            dict(
                tp=tp,
                owned_layers_max=owned,
                h2d_bytes_per_rank_replicated=replicated,
                h2d_bytes_per_rank_sharded=sharded,
                h2d_ratio=sharded / replicated,
                d2h_ratio=sharded / replicated,
                broadcast_sent_per_rank_max=sharded,
                broadcast_received_per_rank_max=replicated
                - per_layer * min(len(owned_layers(layers, r, tp)) for r in range(tp)),
                node_dram_read_replicated=replicated * tp,
                node_dram_read_sharded=per_layer * LAYERS,
                unique_tokens_replicated=cap_rep,
                unique_tokens_sharded=cap_shard
                * 1,  # every rank holds the same token slots
                capacity_ratio=cap_shard / cap_rep,
                mtp_capacity_ratio_drafts_replicated=mtp_shipped / mtp_rep,
                mtp_capacity_ratio_drafts_sharded=mtp_sharded / mtp_rep,
                mtp_draft_share_of_host_bytes=MTP_LAYERS / (owned + MTP_LAYERS),
                # A sidecar draft pool (its own host pool, indices following
                # the target KV) takes the target's token capacity: its host
                # memory, on top of --hicache-size, grows with it.
                sidecar_draft_host_gb_replicated=cap_rep * SIDECAR_ROW / 1e9,
                sidecar_draft_host_gb_sharded=cap_shard * SIDECAR_ROW / 1e9,
            )
        )
    return rows


def _cpu_timing(rank, world, args):
    import torch

    from harness.stacks.dsa_hicache_stack import build_dsa_stack

    stack = build_dsa_stack(
        rank,
        world,
        layer_num=args["layers"],
        skip_topk_layers=None,
        size=args["tokens"] + 1024,
        kv_dtype=torch.float8_e4m3fn,
        kv_cache_dim=KV_ROW,
    )
    cc, alloc = stack.controller, stack.allocator
    cc.load_fence_stream = torch.cpu.current_stream()
    shard = getattr(cc, "rank_shard", None)
    if args["mode"] == "copy_only":
        from harness.scenarios.hicache_rank_shard_scenarios import disable_exchange

        disable_exchange(cc)
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    extra = [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]
    dev = alloc.alloc(args["tokens"])
    host = cc.write(dev, node_id=1, extra_pools=extra)
    alloc.free(dev)
    times = []
    for _ in range(args["iters"]):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        d = cc.load(host, node_id=1, extra_pools=extra)
        cc.start_loading()
        times.append(time.perf_counter() - t0)
        alloc.free(d)
    return dict(mode=args["mode"], sharded=shard is not None, times=times)


def cpu_timing(quick: bool) -> dict:
    from harness.gloo_ranks import run_ranks

    args = dict(layers=8, tokens=64 * (64 if quick else 256), iters=3 if quick else 8)
    out = {}
    for mode in ("replicated", "sharded", "copy_only"):
        env = {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "0" if mode == "replicated" else "1"}
        res = run_ranks(_cpu_timing, 2, dict(args, mode=mode), timeout=600, env=env)
        out[mode] = statistics.median(t for r in res for t in r["times"][1:])
    out["params"] = args
    out["sharded_over_replicated"] = out["sharded"] / out["replicated"]
    out["copy_only_over_replicated"] = out["copy_only"] / out["replicated"]
    out["exchange_ms_per_layer"] = (
        (out["sharded"] - out["copy_only"]) * 1e3 / args["layers"]
    )
    out["plain_copy_ms_per_layer"] = out["replicated"] * 1e3 / args["layers"]
    return out


def gpu_tables(root: Path) -> list[dict]:
    rows = []
    for run in sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []:
        modes = {}
        # The run's main pass only: one file per mode under its plain name
        # (variants in the same folder, e.g. sharded_ch2.json, are its own
        # experiments and pair with nothing here).
        for f in (
            run / f"{m}.json" for m in ("replicated", "sharded", "copy_only", "gate")
        ):
            if not f.is_file():
                continue
            rec = json.loads(f.read_text())
            if rec.get("status") != "ok" or not rec["results"]:
                continue
            r0 = rec["results"][0]
            mode = r0["mode"] if r0["tokens"] >= 50_000 else None
            if mode in ("replicated", "sharded", "copy_only"):
                modes[mode] = dict(
                    load_ms=statistics.median(
                        x for r in rec["results"] for x in r["load_event_ms"][1:]
                    ),
                    d2h_ms=statistics.median(r["d2h_event_ms"] for r in rec["results"]),
                    submit_ms=(
                        statistics.median(
                            x for r in rec["results"] for x in r["load_submit_ms"][1:]
                        )
                        if "load_submit_ms" in r0
                        else None
                    ),
                    mismatches=sum(r["restore_mismatches"] for r in rec["results"]),
                    world=r0["world"],
                    gpu=rec["gpu"],
                    # What the stand-in copies did, as each rank reports it.
                    copies=r0.get("standin_copy")
                    or rec.get("standin_copy_env")
                    or "2d",
                )
            elif r0["mode"] == "gate":
                modes["gate" if r0["gate"] else "nogate"] = dict(
                    iters=r0["gate_iters"], bad=r0["gate_bad_allreduce"]
                )
        for f in run.glob("nogate.json"):
            rec = json.loads(f.read_text())
            if rec.get("status") != "ok":
                modes["nogate"] = dict(status=rec["status"][:80])
        if "replicated" in modes and "sharded" in modes:
            rep, sh = modes["replicated"], modes["sharded"]
            rows.append(
                dict(
                    run=run.name,
                    gpu=rep["gpu"],
                    copies=rep["copies"],
                    tp=rep["world"],
                    replicated_load_ms=rep["load_ms"],
                    sharded_load_ms=sh["load_ms"],
                    load_ratio=sh["load_ms"] / rep["load_ms"],
                    copy_only_ratio=(
                        modes["copy_only"]["load_ms"] / rep["load_ms"]
                        if "copy_only" in modes
                        else None
                    ),
                    d2h_ratio=sh["d2h_ms"] / rep["d2h_ms"],
                    sharded_submit_ms=sh["submit_ms"],
                    sharded_mismatches=sh["mismatches"],
                    gate=modes.get("gate"),
                    nogate=modes.get("nogate"),
                )
            )
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu-results", type=Path, default=HERE / "results")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()

    geo = geometry_table()
    print(
        f"DeepSeek-V3.2 geometry, {PREFIX} token prefix, --hicache-size {HOST_GB} GB/rank"
    )
    print(
        f"{'tp':>3} {'owned':>5} {'H2D/D2H per rank':>17} {'bcast sent GB':>13} "
        f"{'node DRAM read':>14} {'unique tokens':>14}"
    )
    for r in geo:
        print(
            f"{r['tp']:>3} {r['owned_layers_max']:>5} {r['h2d_ratio']:>16.3f}x "
            f"{r['broadcast_sent_per_rank_max'] / 1e9:>13.2f} "
            f"{r['node_dram_read_sharded'] / r['node_dram_read_replicated']:>13.3f}x "
            f"{r['capacity_ratio']:>13.2f}x"
        )
    print(
        f"\n{MTP_LAYERS} MTP draft layer, unique tokens packed: {'tp':>3} "
        f"{'replicated':>10} {'sharded':>8} {'draft bytes':>11}   "
        f"as a sidecar, GB/rank: {'unsharded':>9} {'sharded':>8}"
    )
    for r in geo:
        print(
            f"{'':>34}{r['tp']:>3} "
            f"{r['mtp_capacity_ratio_drafts_replicated']:>9.2f}x "
            f"{r['mtp_capacity_ratio_drafts_sharded']:>7.2f}x "
            f"{r['mtp_draft_share_of_host_bytes']:>11.3f}   {'':>22} "
            f"{r['sidecar_draft_host_gb_replicated']:>9.1f} "
            f"{r['sidecar_draft_host_gb_sharded']:>8.1f}"
        )
    cpu = cpu_timing(args.quick)
    print(
        f"\nCPU gloo, 2 ranks, {cpu['params']['layers']} layers, {cpu['params']['tokens']} "
        f"tokens: sharded/replicated {cpu['sharded_over_replicated']:.3f}, "
        f"copy-only/replicated {cpu['copy_only_over_replicated']:.3f}, exchange "
        f"{cpu['exchange_ms_per_layer']:.2f} ms/layer vs plain copy "
        f"{cpu['plain_copy_ms_per_layer']:.2f} ms/layer"
    )
    gpu = gpu_tables(args.gpu_results)
    if gpu:
        print(
            "\nGPU load-back of a 100K-token DSA prefix through the patched path (median)"
        )
        print(
            f"{'run':<22} {'copies':>6} {'tp':>2} {'replicated ms':>13} "
            f"{'sharded ms':>10} {'ratio':>6} {'copy-only':>9} {'D2H ratio':>9} "
            f"{'mismatch':>8} {'submit ms':>13}"
        )
        for g in gpu:
            co = f"{g['copy_only_ratio']:.3f}" if g["copy_only_ratio"] else "-"
            print(
                f"{g['run']:<22} {g['copies']:>6} {g['tp']:>2} "
                f"{g['replicated_load_ms']:>13.1f} "
                f"{g['sharded_load_ms']:>10.1f} {g['load_ratio']:>6.3f} {co:>9} "
                f"{g['d2h_ratio']:>9.3f} {g['sharded_mismatches']:>8} "
                f"{g['sharded_submit_ms'] or float('nan'):>13.1f}"
            )
    out = run_dir(args.out, "rank-shard")
    record = dict(
        **run_metadata(),
        geometry=geo,
        cpu=cpu,
        gpu=gpu,
    )
    (out / "bench_rank_shard.json").write_text(json.dumps(record, indent=1))
    _plot(geo, cpu, gpu, out / "bench_rank_shard.png")
    print(f"\nwrote {out / 'bench_rank_shard.json'} and .png")


def _plot(geo, cpu, gpu, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    tps = [r["tp"] for r in geo]
    ax = axes[0]
    ax.bar([str(t) for t in tps], [r["h2d_ratio"] for r in geo], color="tab:blue")
    ax.axhline(1.0, color="gray", ls="--", label="replicated")
    ax.set_title("host copy bytes per rank (x replicated)")
    ax.set_xlabel("tp")
    ax.legend()
    ax = axes[1]
    ax.bar([str(t) for t in tps], [r["capacity_ratio"] for r in geo], color="tab:green")
    ax.set_title(f"unique host tokens at {HOST_GB:.0f} GB/rank (x)")
    ax.set_xlabel("tp")
    ax = axes[2]
    labels = ["CPU sharded", "CPU copy-only"]
    values = [cpu["sharded_over_replicated"], cpu["copy_only_over_replicated"]]
    for g in gpu:
        labels.append(f"GPU {g['run']}")
        values.append(g["load_ratio"])
    ax.barh(labels, values, color="tab:orange")
    ax.axvline(1.0, color="gray", ls="--")
    ax.axvline(0.55, color="red", ls=":", label="target 0.55 (TP2)")
    ax.set_title("load-back time / replicated (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
