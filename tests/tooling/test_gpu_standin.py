"""The GPU ``sgl_kernel`` stand-in (tests/standins/gpu) on CPU.

Its memoized page-run plans must never be stale, and both its batched copies
(one ``cudaMemcpyBatchAsync`` entry per page, as sglang-kernel issues them) and
its strided 2-D copies must write exactly what the per-page CPU stand-in
(tests/standins/cpu_kvcacheio_standin.py, the real op's semantics) writes. The
CUDA calls are replaced by host ``memmove``s on CPU tensors (per entry, per row), so the
very addresses, sizes and pitches the GPU stand-in computes are exercised.
"""

from __future__ import annotations

import ctypes
import importlib.util
import random
import sys
import types
from pathlib import Path

import pytest
import torch

from standins import cpu_kvcacheio_standin as reference

GPU = Path(__file__).resolve().parents[1] / "standins" / "gpu" / "sgl_kernel"


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_standin(monkeypatch):
    """The stand-in's modules, loaded by path under a throw-away ``sgl_kernel``
    (the real package's import hook is never installed in this process)."""
    package = types.ModuleType("sgl_kernel")
    package.missing_op = lambda name: None
    monkeypatch.setitem(sys.modules, "sgl_kernel", package)
    monkeypatch.delitem(sys.modules, "sgl_kernel.page_runs", raising=False)
    monkeypatch.delitem(sys.modules, "sgl_kernel.kvcacheio", raising=False)
    page_runs = load_module("sgl_kernel.page_runs", GPU / "page_runs.py")
    kvio = load_module("sgl_kernel.kvcacheio", GPU / "kvcacheio.py")

    def memcpy2d(dst, dst_pitch, src, src_pitch, width, height):
        assert width <= dst_pitch and width <= src_pitch
        for r in range(height):
            ctypes.memmove(dst + r * dst_pitch, src + r * src_pitch, width)

    def memcpy_batch(dsts, srcs, sizes):
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)

    monkeypatch.setattr(kvio, "cupy", object())  # take the 2-D copy branch
    monkeypatch.setattr(kvio, "_copy2d", memcpy2d)
    # The batched copy's entries, applied by host memmoves (no CUDA here).
    monkeypatch.setattr(kvio, "_copy_batch", memcpy_batch)
    monkeypatch.setattr(kvio, "_use_batch", lambda: kvio.MODE == "batch")
    page_runs.clear()
    yield page_runs, kvio
    for name in ("sgl_kernel.page_runs", "sgl_kernel.kvcacheio"):
        sys.modules.pop(name, None)


def _python_runs(src, dst, src_step, dst_step):
    runs = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n * src_step and d == d0 + n * dst_step:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return tuple(runs)


def _token_indices(pages, page_size):
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def _shuffled_pages(rng, total, count):
    """Page numbers with runs of random length, some reversed, some gaps."""
    pages, p = [], rng.randrange(4)
    while len(pages) < count:
        n = rng.randint(1, 6)
        pages.extend(range(p, p + n))
        p += n + rng.choice([0, 0, 1, 3])
    pages = pages[:count]
    pages = [q % total for q in pages]
    cut = rng.randrange(count)
    return pages[cut:] + pages[:cut]


def test_runs_match_the_python_grouping(gpu_standin):
    page_runs, _ = gpu_standin
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 40)
        src = torch.tensor(_shuffled_pages(rng, 64, n) if n else [], dtype=torch.int64)
        dst = torch.tensor(_shuffled_pages(rng, 64, n) if n else [], dtype=torch.int64)
        for step in (1, 2):
            want = _python_runs(
                (src * step).tolist(), (dst * step).tolist(), step, step
            )
            assert page_runs.find_runs(src * step, dst * step, step, step) == want


def test_plan_is_never_stale(gpu_standin):
    page_runs, _ = gpu_standin
    ps = 4
    src = _token_indices([0, 1, 2, 3], ps)
    dst = _token_indices([7, 8, 9, 10], ps)
    assert page_runs.plan(src, dst, ps, ps, ps) == ((0, 28, 4),)
    assert page_runs.plan(src.clone(), dst.clone(), ps, ps, ps) == ((0, 28, 4),)
    assert page_runs.stats == {"hits": 1, "misses": 1}
    # The same tensors rewritten in place (same address and numel), and a fresh
    # tensor at a recycled address: both must get a new plan.
    dst.copy_(_token_indices([7, 8, 20, 21], ps))
    assert page_runs.plan(src, dst, ps, ps, ps) == ((0, 28, 2), (8, 80, 2))
    del dst
    dst = _token_indices([1, 3, 5, 7], ps)
    assert page_runs.plan(src, dst, ps, ps, ps) == tuple(
        (s, d, 1) for s, d in zip([0, 4, 8, 12], [4, 12, 20, 28])
    )
    # Mutating the caller's tensor after a miss must not change the stored key.
    dst[0] = 99
    assert page_runs.plan(src, dst, ps, ps, ps)[0] == (0, 99, 1)
    # Different steps or page sizes never share a plan.
    assert page_runs.plan(src, src, 1, 1, 1) != page_runs.plan(src, src, 1, 2, 2)
    assert page_runs.stats["misses"] == 6


def _pf_host(pages, layers, ps, dim, gen):
    return torch.randint(0, 256, (pages, layers, ps, 1, dim), generator=gen).to(
        torch.uint8
    )


@pytest.mark.parametrize("mode", ["batch", "2d"])
@pytest.mark.parametrize("ps,dim", [(4, 24), (1, 40)])
def test_copies_match_the_per_page_standin(gpu_standin, monkeypatch, ps, dim, mode):
    _, kvio = gpu_standin
    monkeypatch.setattr(kvio, "MODE", mode)
    gen = torch.Generator().manual_seed(ps)
    rng = random.Random(ps)
    layers, host_pages, dev_pages, count = 3, 24, 32, 12
    for trial in range(6):
        host_idx = _token_indices(_shuffled_pages(rng, host_pages, count), ps)
        dev_idx = _token_indices(_shuffled_pages(rng, dev_pages, count), ps)
        if trial % 2:  # repeat pages on both sides in one call: plan hit
            dev_idx = dev_idx.clone()
        # H2D: host page-first -> device layer-first, every layer.
        host = _pf_host(host_pages, layers, ps, dim, gen)
        for layer in range(layers):
            want = torch.zeros(dev_pages * ps, 1, dim, dtype=torch.uint8)
            got = want.clone()
            reference.transfer_kv_per_layer_direct_pf_lf(
                [host], [want], host_idx, dev_idx, layer, ps
            )
            kvio.transfer_kv_per_layer_direct_pf_lf(
                [host], [got], host_idx, dev_idx, layer, ps
            )
            assert torch.equal(got, want)
        # D2H: device layer-first -> host page-first, all layers.
        dev = [
            torch.randint(0, 256, (dev_pages * ps, 1, dim), generator=gen).to(
                torch.uint8
            )
            for _ in range(layers)
        ]
        want = torch.zeros_like(host)
        got = want.clone()
        reference.transfer_kv_all_layer_direct_lf_pf(dev, [want], dev_idx, host_idx, ps)
        kvio.transfer_kv_all_layer_direct_lf_pf(dev, [got], dev_idx, host_idx, ps)
        assert torch.equal(got, want)
