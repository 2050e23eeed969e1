"""Does an NCCL broadcast between the two GPUs slow a concurrent host copy?

Two ranks (one GPU each, NCCL), no sglang. Each rank times ``--layers`` host-to-
device copies of one DSA KV layer share (CUDA events on a copy stream), either
contiguous or strided like ``page_first_direct`` (one 2-D copy per layer: a
page's rows of that layer are contiguous in host memory, pages are
``--host-layers`` layers apart), alone and while a second stream runs the
rank-shard exchange's traffic: per layer one broadcast of ``--bcast-mb`` MB,
owners alternating. Prints and writes JSON with the ratios against the
contiguous copy alone.

Run on a 2-GPU host: ``python -m benchmark.hicache_rank_shard.probes.h2d_nccl_probe --out probe.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmark.bench_meta import run_metadata


def _memcpy2d():
    """cudaMemcpy2DAsync from the CUDA runtime next to torch (or CuPy's)."""
    try:
        import cupy

        def fn(dst, dpitch, src, spitch, width, height, kind, stream):
            cupy.cuda.runtime.memcpy2DAsync(
                dst, dpitch, src, spitch, width, height, kind, stream
            )
            return 0

        return fn
    except ImportError:
        pass
    import sys

    libs = [
        path
        for root in sys.path
        for path in glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"))
    ]
    libs += glob.glob(
        os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*")
    )
    rt = ctypes.CDLL(libs[0] if libs else "libcudart.so")
    fn = rt.cudaMemcpy2DAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
    fn.argtypes += [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return fn


def worker(rank, a, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    dev = torch.device("cuda", rank)
    width = a.page_size * a.row_bytes  # one page of one layer
    pages = a.tokens // a.page_size
    host = torch.empty(
        pages * a.host_layers * width, dtype=torch.uint8, pin_memory=True
    )
    dst = torch.empty(pages * width, dtype=torch.uint8, device=dev)
    bcast = torch.empty(int(a.bcast_mb * 1e6), dtype=torch.uint8, device=dev)
    copy_stream, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    memcpy2d = _memcpy2d()

    def copy_layer(layer, strided):
        if strided:
            err = memcpy2d(
                dst.data_ptr(),
                width,
                host.data_ptr() + layer * width,
                a.host_layers * width,
                width,
                pages,
                1,  # cudaMemcpyHostToDevice
                copy_stream.cuda_stream,
            )
            assert err == 0, err
        else:
            off = layer * pages * width % (host.numel() - pages * width)
            dst.copy_(host[off : off + pages * width], non_blocking=True)

    def one_pass(strided, with_bcast):
        dist.barrier()
        torch.cuda.synchronize()
        if with_bcast:
            with torch.cuda.stream(side):
                for layer in range(a.layers * 2):
                    dist.broadcast(bcast, src=layer % 2)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with torch.cuda.stream(copy_stream):
            start.record()
            for layer in range(a.layers):
                copy_layer(layer, strided)
            end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    one_pass(False, True)  # warm up NCCL and the copy paths
    out = {}
    for strided in (False, True):
        for with_bcast in (False, True):
            key = ("strided" if strided else "contiguous") + (
                "+bcast" if with_bcast else ""
            )
            out[key] = statistics.median(
                one_pass(strided, with_bcast) for _ in range(a.reps)
            )
    q.put((rank, out))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=99968)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--row-bytes", type=int, default=656)
    ap.add_argument("--host-layers", type=int, default=31)
    ap.add_argument("--layers", type=int, default=31)
    ap.add_argument("--bcast-mb", type=float, default=78.8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default="h2d_nccl_probe.json")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a, a.port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    base = {r: res["contiguous"] for r, res in results.items()}
    out = {
        **run_metadata(),
        "args": {k: v for k, v in vars(a).items() if k != "out"},
        "h2d_ms": results,
        "ratio_vs_contiguous_alone": {
            r: {k: v / base[r] for k, v in res.items()} for r, res in results.items()
        },
    }
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
