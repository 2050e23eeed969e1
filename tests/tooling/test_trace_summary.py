"""``benchmark/hicache_rank_shard/trace_summary.py`` on a synthetic trace.

Two layers on one rank that owns layer 0: layer 0's host copy, its exchange
(gather + NCCL broadcast on other streams), a host copy of layer 1 launched
late (an idle gap caused by the CPU), one launched in time but held back (a
dependency gap), layer 1's exchange (NCCL + scatter) and a tail.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmark/hicache_rank_shard"


@pytest.fixture(scope="module")
def ts():
    spec = importlib.util.spec_from_file_location(
        "trace_summary", PATH / "trace_summary.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ann(name, ts, dur):
    return dict(ph="X", cat="user_annotation", name=name, ts=ts, dur=dur, tid=1)


def _rt(corr, ts, name="cudaLaunchKernel"):
    return dict(
        ph="X", cat="cuda_runtime", name=name, ts=ts, dur=2, args=dict(correlation=corr)
    )


def _gpu(corr, ts, dur, stream, name, cat="kernel", nbytes=0):
    args = dict(correlation=corr, stream=stream, device=0)
    if nbytes:
        args["bytes"] = nbytes
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args=args)


HTOD = "Memcpy HtoD (Pinned -> Device)"
NCCL = "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
GATHER = "void at::native::indexSelectLargeIndex<long, long, unsigned int, 2, 2, -2>"
SCATTER = "void at::native::gpu_kernel_impl<at::native::index_copy_kernel_impl<long>>"


def _events():
    H2D, SIDE, NC = 7, 21, 33
    return [
        _ann("rs.load", 1000, 500),
        _ann("rs.copy.0", 1010, 20),
        _rt(1, 1015, "cudaMemcpy2DAsync"),
        _gpu(1, 1020, 1000, H2D, HTOD, "gpu_memcpy", 1000 * 50_000),
        _ann("rs.exchange.0", 1040, 30),
        _rt(2, 1045),
        _gpu(2, 2030, 100, SIDE, GATHER),
        _rt(3, 1050, "cuLaunchKernelEx"),
        _gpu(3, 2140, 250, NC, NCCL),
        # Layer 1's copy launched after layer 0's copy ended: CPU gap.
        _ann("rs.copy.1", 2090, 40),
        _rt(4, 2100, "cudaMemcpy2DAsync"),
        _gpu(4, 2110, 500, H2D, HTOD, "gpu_memcpy", 500 * 50_000),
        # A second copy of layer 1, launched in time but started late.
        _rt(5, 2120, "cudaMemcpy2DAsync"),
        _gpu(5, 2700, 300, H2D, HTOD, "gpu_memcpy", 300 * 50_000),
        _ann("rs.exchange.1", 2140, 30),
        _rt(6, 2150, "cuLaunchKernelEx"),
        _gpu(6, 3010, 250, NC, NCCL),
        _rt(7, 2160),
        _gpu(7, 3270, 100, SIDE, SCATTER),
        # Flow events and CPU ops are ignored.
        dict(ph="s", cat="ac2g", name="ac2g", ts=1015, id=1),
        dict(ph="X", cat="cpu_op", name="aten::index_select", ts=1045, dur=3),
    ]


def test_classify(ts):
    assert ts.classify(dict(cat="gpu_memcpy", name=HTOD)) == "memcpy_htod"
    assert ts.classify(dict(cat="gpu_memcpy", name="Memcpy DtoD")) == "memcpy_other"
    assert ts.classify(dict(cat="kernel", name=NCCL)) == "nccl"
    assert ts.classify(dict(cat="kernel", name=GATHER)) == "gather"
    assert ts.classify(dict(cat="kernel", name=SCATTER)) == "scatter"
    vectorized = "void at::native::vectorized_gather_kernel<16, long>(char*, char*)"
    assert ts.classify(dict(cat="kernel", name=vectorized)) == "gather"
    assert ts.classify(dict(cat="kernel", name="elementwise_kernel")) == "other"


def test_summary(ts):
    s = ts.summarize(_events())
    assert s["gpu_ops"] == 7
    assert s["annotated_spans"] == 4
    assert s["cpu_submit_ms"] == 0.5
    assert s["first_copy_ms"] == 0.02
    assert s["last_copy_end_ms"] == 2.0
    assert s["copy_busy_ms"] == 1.8
    assert s["copy_span_ms"] == 1.98
    assert s["gpu_end_ms"] == 2.37
    assert s["tail_after_last_copy_ms"] == 0.37
    assert s["htod_bytes"] == 1800 * 50_000
    # Gaps: 90 us (launched at 2100 > 2020: cpu), 90 us (launched at 2120 <
    # 2610: dependency).
    assert s["h2d_idle_ms"] == dict(total=0.18, cpu=0.09, dependency=0.09)
    assert s["h2d_gaps"] == 2
    causes = {(g["cause"], g["next_layer"]) for g in s["h2d_largest_gaps"]}
    assert causes == {("cpu", 1), ("dependency", 1)}
    roles = {d["stream"]: d["role"] for d in s["streams"]}
    assert roles == {7: "h2d", 21: "exchange", 33: "nccl"}
    side = next(d for d in s["streams"] if d["stream"] == 21)
    assert side["busy_by_class_ms"] == dict(gather=0.1, scatter=0.1)
    l0, l1 = s["layers"]
    assert l0["copy_ms"] == [0.02, 1.02] and l0["exchange_ms"] == [1.03, 1.39]
    assert l0["exchange_after_copy_ms"] == 0.01
    assert l0["nccl_ms"] == 0.25 and l0["gather_ms"] == 0.1
    assert l1["copy_ms"] == [1.11, 2.0] and l1["exchange_ms"] == [2.01, 2.37]
    assert l1["scatter_ms"] == 0.1 and "gather_ms" not in l1
    assert l1["cpu_copy_ms"] == 1.09
    # The second copy ran beside the gather and layer 0's broadcast for more
    # than half its time, the other two alone (all at 50 GB/s).
    assert s["htod_gbps"] == dict(
        alone=50.0, beside_kernels=50.0, bytes_beside_kernels=500 * 50_000
    )
    calls = {c["name"]: c for c in s["runtime_calls"]}
    assert calls["cudaMemcpy2DAsync"] == dict(
        name="cudaMemcpy2DAsync", count=3, total_ms=0.006, max_ms=0.002
    )
    assert s["other_kernels"] == []
    assert s["nccl_kernels"] == dict(count=2, total_ms=0.5, mean_ms=0.25, max_ms=0.25)


def test_no_gpu_events(ts):
    s = ts.summarize([_ann("rs.load", 0, 10), _ann("rs.copy.0", 1, 2)])
    assert s == dict(gpu_ops=0, annotated_spans=1)
