"""Rank-sharded HiCache load-back on GPUs through the patched code path.

One process per GPU (TP = number of GPUs), NCCL world group; each rank builds
a DeepSeek-V3.2-shaped DSA stack (61 layers, FP8 latent 656 B + indexer 132 B
per token per layer) through upstream's ``_DsaStrategy.build`` on CUDA with
real pinned host memory, backs up a prefix and loads it back many times
through ``HiCacheController.start_loading``; every restore is checked bit for
bit on every rank. Modes, each a separate launch (the flag is read at build):

* ``replicated``: flag off, every rank copies every layer (upstream);
* ``sharded``: SGLANG_ENABLE_HICACHE_RANK_SHARD=1 (VERIFY_EVERY=1);
* ``copy_only``: sharded with the exchange skipped (owned-share copy time);
* ``gate``: sharded load-backs interleaved with TP all-reduces standing in
  for the forward's collectives, waiting through the real
  ``LayerDoneCounter.set_consumer`` gate (``--no-gate`` removes it).

``--trace`` profiles one more load (torch.profiler, CPU + CUDA) on every rank
and stores a summary of its GPU timeline (``trace_summary.py``): per-stream
busy time by class of work, the H2D stream's idle gaps, each layer's copy and
exchange spans, the tail after the last copy.

Needs the patched sglang wheel and, without sgl-kernel, the test-only
``tests/standins/gpu`` package first on PYTHONPATH. Writes one JSON per mode;
``bench_rank_shard.py --gpu-results DIR`` turns them into the table and plot.

    python -m benchmark.hicache_rank_shard.gpu_tp_run --mode sharded --out out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmark.bench_meta import run_metadata

LAYERS = 61
ROW = 656  # FP8 DSA latent bytes per token per layer


def _extra():
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)]


def _elapsed_ms(ack) -> float:
    return (
        ack.start_event.elapsed_time(ack.finish_event) if ack.timing_enabled else -1.0
    )


def worker(rank: int, world: int, args: dict) -> dict:
    from harness.stacks.dsa_hicache_stack import build_dsa_stack

    cuda = args["device"] == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokens = args["tokens"]
    stack = build_dsa_stack(
        rank,
        world,
        layer_num=args["layers"],
        skip_topk_layers=None,
        size=tokens + 4096,
        page_size=64,
        kv_dtype=torch.float8_e4m3fn,
        kv_cache_dim=ROW,
        device=device,
        server_args_overrides=dict(hicache_ratio=1.1),
    )
    pool, alloc, cc = stack.device_pool, stack.allocator, stack.controller
    fwd = torch.cuda.current_stream() if cuda else torch.cpu.current_stream()
    cc.load_fence_stream = fwd
    shard = getattr(cc, "rank_shard", None)
    if args["mode"] == "copy_only":
        from harness.scenarios.hicache_rank_shard_scenarios import disable_exchange

        disable_exchange(cc)
    gen = torch.Generator(device=device).manual_seed(1234)
    live = list(range(args["layers"]))
    for buf in list(pool.kv_buffer) + [pool.index_k_with_scale_buffer[i] for i in live]:
        buf.view(torch.uint8).copy_(
            torch.randint(
                0, 256, buf.shape, generator=gen, device=device, dtype=torch.uint8
            )
        )
    out = dict(
        rank=rank,
        world=world,
        mode=args["mode"],
        sharded=shard is not None,
        tokens=tokens,
        kv_host_layers=list(stack.kv_host._target_layer_indices),
        host_capacity_tokens=stack.kv_host.size,
        host_bytes=stack.kv_host.kv_buffer.numel()
        + stack.indexer_host.index_k_with_scale_buffer.numel(),
    )
    ps = stack.page_size
    if args["mode"] == "gate":
        return _gate_loop(stack, args, out, device)

    dev = alloc.alloc(tokens)
    pages = dev[::ps] // ps
    ref_kv = [b[dev].clone() for b in pool.kv_buffer]
    ref_ix = [pool.index_k_with_scale_buffer[i][pages].clone() for i in live]
    sync()
    t0 = time.perf_counter()
    host = cc.write(dev, node_id=1, extra_pools=_extra())
    sync()
    out["d2h_wall_ms"] = (time.perf_counter() - t0) * 1e3
    out["d2h_event_ms"] = _elapsed_ms(cc.ack_write_queue[-1])
    alloc.free(dev)
    loads, mismatches = [], 0
    for it in range(args["iters"]):
        for b in pool.kv_buffer:
            b.view(torch.uint8).zero_()
        for i in live:
            pool.index_k_with_scale_buffer[i].view(torch.uint8).zero_()
        sync()
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        d = cc.load(host, node_id=1, extra_pools=_extra())
        cc.start_loading()
        submit = (time.perf_counter() - t0) * 1e3  # CPU time to issue the load
        sync()
        wall = (time.perf_counter() - t0) * 1e3
        loads.append((wall, _elapsed_ms(cc.ack_load_queue[-1]), submit))
        p = d[::ps] // ps
        ok = all(
            torch.equal(pool.kv_buffer[l][d], ref_kv[l]) for l in range(len(ref_kv))
        )
        ok &= all(
            torch.equal(pool.index_k_with_scale_buffer[i][p], ref_ix[j])
            for j, i in enumerate(live)
        )
        mismatches += 0 if ok else 1
        alloc.free(d)
        cc.ack_load_queue.clear()
    if args["profile"]:
        out["profile"] = _profile_one_load(cc, host, alloc, sync)
    if args["trace"]:
        out["trace"] = _trace_one_load(cc, host, alloc, sync)
    try:  # the GPU stand-in's copies and page-run plan cache (tests/standins/gpu)
        from sgl_kernel import kvcacheio as standin
        from sgl_kernel.page_runs import stats

        out["standin_plan_cache"] = dict(stats)
        out["standin_copy"] = standin.copy_mode()
    except (ImportError, AttributeError):
        pass
    out["load_wall_ms"] = [w for w, _, _ in loads]
    out["load_event_ms"] = [e for _, e, _ in loads]
    out["load_submit_ms"] = [s for _, _, s in loads]
    out["restore_mismatches"] = mismatches
    if shard is not None:
        out["bytes_sent"] = shard.exchange.bytes_sent
        out["bytes_received"] = shard.exchange.bytes_received
    return out


def _profile_one_load(cc, host, alloc, sync, top=25) -> list:
    """cProfile of one more load's submission: the functions with the most own
    time (file base names only)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    d = cc.load(host, node_id=1, extra_pools=_extra())
    cc.start_loading()
    prof.disable()
    sync()
    alloc.free(d)
    cc.ack_load_queue.clear()
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in pstats.Stats(
        prof
    ).stats.items():
        rows.append(
            (f"{Path(file).name}:{line}({name})", ncalls, tottime * 1e3, cumtime * 1e3)
        )
    rows.sort(key=lambda r: -r[2])
    return [
        dict(func=f, ncalls=n, tottime_ms=t, cumtime_ms=c) for f, n, t, c in rows[:top]
    ]


def _trace_one_load(cc, host, alloc, sync) -> dict:
    """torch.profiler (CPU + CUDA) of one more load, the layer loop annotated
    (``rs.load``, ``rs.copy.<l>``, ``rs.exchange.<l>``); returns the summary
    of ``trace_summary.summarize``, not the trace (deleted)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmark.hicache_rank_shard.trace_summary import summarize

    engine = cc.l2_transfer_engine
    exchange = getattr(getattr(cc, "rank_shard", None), "exchange", None)
    load_layer = engine._load_layer
    exchange_layer = exchange.exchange_layer if exchange is not None else None

    def traced_load_layer(transfers, primary, layer_id, *rest):
        with record_function(f"rs.copy.{layer_id}"):
            return load_layer(transfers, primary, layer_id, *rest)

    def traced_exchange_layer(layer_id, transfers, on_layer_done=None):
        with record_function(f"rs.exchange.{layer_id}"):
            return exchange_layer(layer_id, transfers, on_layer_done)

    engine._load_layer = traced_load_layer
    if exchange is not None:
        exchange.exchange_layer = traced_exchange_layer
    sync()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    try:
        with profile(activities=acts) as prof:
            with record_function("rs.load"):
                d = cc.load(host, node_id=1, extra_pools=_extra())
                cc.start_loading()
            sync()
    finally:
        del engine._load_layer
        if exchange is not None:
            exchange.exchange_layer = exchange_layer
    event_ms = _elapsed_ms(cc.ack_load_queue[-1])
    alloc.free(d)
    cc.ack_load_queue.clear()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    summary = summarize(events)
    summary["load_event_ms"] = event_ms
    summary["trace_events"] = len(events)
    return summary


def _gate_loop(stack, args, out, device) -> dict:
    """Sharded load-backs interleaved with all-reduces on the TP communicator."""
    import torch.distributed as dist

    pool, alloc, cc = stack.device_pool, stack.allocator, stack.controller
    if args["no_gate"]:
        cc.layer_done_counter.rank_shard_gate = None
    small = 64 * 32
    dev = alloc.alloc(small)
    host = cc.write(dev, node_id=1, extra_pools=_extra())
    ref = [b[dev].clone() for b in pool.kv_buffer]
    alloc.free(dev)
    x = torch.ones(1 << 20, device=device)
    bad_sum = bad_restore = 0
    t0 = time.perf_counter()
    for it in range(args["gate_iters"]):
        d = cc.load(host, node_id=1, extra_pools=_extra())
        cc.start_loading()
        cc.layer_done_counter.set_consumer(-1)  # the forward's gate
        x.fill_(1.0)
        dist.all_reduce(x)  # forward collective on the TP communicator
        if it % 50 == 0:
            bad_sum += int(x[0].item() != float(out["world"]))
            bad_restore += int(
                not all(
                    torch.equal(pool.kv_buffer[l][d], ref[l]) for l in range(len(ref))
                )
            )
        alloc.free(d)
        cc.ack_load_queue.clear()
    torch.cuda.synchronize()
    out.update(
        gate=not args["no_gate"],
        gate_iters=args["gate_iters"],
        gate_seconds=time.perf_counter() - t0,
        gate_bad_allreduce=bad_sum,
        gate_bad_restore=bad_restore,
    )
    return out


def main():
    from harness.gloo_ranks import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["replicated", "sharded", "copy_only", "gate"])
    ap.add_argument("--tokens", type=int, default=100_000 // 64 * 64)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--gate-iters", type=int, default=2000)
    ap.add_argument("--no-gate", action="store_true")
    ap.add_argument("--world", type=int, default=0, help="default: all GPUs")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--staging-mb", type=int, default=0, help="0: the default")
    ap.add_argument("--profile", action="store_true", help="cProfile one more load")
    ap.add_argument(
        "--trace", action="store_true", help="GPU timeline summary of one more load"
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    world = a.world or (torch.cuda.device_count() if a.device == "cuda" else 2)
    env = {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "0" if a.mode == "replicated" else "1"}
    if a.mode != "replicated":
        env["SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY"] = "1"
    if a.staging_mb:
        env["SGLANG_HICACHE_RANK_SHARD_STAGING_MB"] = str(a.staging_mb)
    args = dict(
        mode=a.mode,
        tokens=a.tokens,
        layers=a.layers,
        iters=a.iters,
        gate_iters=a.gate_iters,
        no_gate=a.no_gate,
        device=a.device,
        profile=a.profile,
        trace=a.trace,
    )
    t0 = time.perf_counter()
    try:
        results = run_ranks(
            worker,
            world,
            args,
            timeout=a.timeout,
            backend="nccl" if a.device == "cuda" else "gloo",
            env=env,
        )
        status = "ok"
    except Exception as e:  # a hang (timeout) or a failure is a result too
        results, status = [], f"{type(e).__name__}: {str(e)[-1500:]}"
    record = dict(
        **run_metadata(),
        args=dict(vars(a), out=Path(a.out).name),
        status=status,
        seconds=time.perf_counter() - t0,
        gpu=torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
        nccl_env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
        standin_copy_env=os.environ.get("SGL_STANDIN_COPY"),
        results=results,
    )
    Path(a.out).write_text(json.dumps(record, indent=1))
    print(a.mode, status, f"{record['seconds']:.1f}s")
    for r in results:
        keys = (
            "rank",
            "sharded",
            "restore_mismatches",
            "d2h_event_ms",
            "gate_bad_allreduce",
            "standin_copy",
        )
        print({k: r.get(k) for k in keys}, "load ms:", r.get("load_event_ms", [])[:5])
        print("   submit ms:", [round(x, 1) for x in r.get("load_submit_ms", [])[:5]])
        if "trace" in r:
            t = r["trace"]
            keys = ("load_event_ms", "copy_span_ms", "copy_busy_ms", "h2d_idle_ms")
            print(
                "   trace:", {k: t.get(k) for k in keys + ("tail_after_last_copy_ms",)}
            )


if __name__ == "__main__":
    main()
