"""The two ``page_first_direct`` direct ops on CUDA tensors (test-only stand-in).

Semantics per page ``i`` (``ps`` = page size; see
tests/standins/cpu_kvcacheio_standin.py):
D2H ``dst[b][dst_idx[i*ps] // ps][j][:ps] = src[b*L + j][src_idx[i*ps] : +ps]``;
H2D ``dst[b][dst_idx[i*ps] : +ps] = src[b][src_idx[i*ps] // ps][layer_id]``.

How the copies are issued (``SGL_STANDIN_COPY``):

* ``2d`` (default): one strided ``cudaMemcpy2DAsync`` per run of consecutive
  pages (through CuPy): the same bytes at the least host cost, so a run
  measures the data path (copies, exchange, their overlap on the GPU);
* ``batch``: like sglang-kernel 0.4.10's ``transfer.cu``, one
  ``cudaMemcpyBatchAsync`` per call with one entry per page (and per layer
  for D2H), on the current stream; the function is found with ``dlsym`` in
  the process's own CUDA runtime (torch's) and called with that runtime's
  signature (CUDA 13 dropped ``failIdx``). On the 2xH200 machines here the
  call costs the host about 1 ms per 1563 entries, more than the copy takes
  on the GPU (see ../README.md). Falls back to ``2d`` where the runtime
  lacks it;
* without CuPy, one ``copy_`` per page.

The runs come from ``page_runs.plan``, memoized by index content, so the
host cost per call stays near the real op's (see ../README.md).
"""

import ctypes
import os

import torch
from sgl_kernel import missing_op
from sgl_kernel.page_runs import equal_count, page_starts, plan

try:
    import cupy
except ImportError:  # pragma: no cover
    cupy = None

MODE = os.environ.get("SGL_STANDIN_COPY", "2d")


def _copy2d(dst, dst_pitch, src, src_pitch, width, height):
    stream = torch.cuda.current_stream().cuda_stream
    cupy.cuda.runtime.memcpy2DAsync(
        dst, dst_pitch, src, src_pitch, width, height, 4, stream  # 4: default kind
    )


# ------------------------------------------------------ cudaMemcpyBatchAsync
class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
_batch_fn = None  # (function, runtime version), found on first use


def _batch_function():
    global _batch_fn
    if _batch_fn is None:
        _batch_fn = (None, 0)
        if torch.cuda.is_available():
            torch.cuda.init()  # torch's CUDA runtime is loaded and initialised
            libc = ctypes.CDLL(None)
            libc.dlsym.restype = ctypes.c_void_p
            libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            fn = libc.dlsym(None, b"cudaMemcpyBatchAsync")
            ver = libc.dlsym(None, b"cudaRuntimeGetVersion")
            if fn and ver:
                version = ctypes.c_int(0)
                ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(ver)(
                    ctypes.byref(version)
                )
                _batch_fn = (fn, version.value)
    return _batch_fn


def _copy_batch(dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor):
    """One ``cudaMemcpyBatchAsync`` of ``len(dsts)`` copies on the current
    stream (int64 CPU tensors of addresses and byte counts)."""
    fn, version = _batch_function()
    p = ctypes.c_void_p
    attrs = _MemcpyAttributes(srcAccessOrder=_ACCESS_ORDER_STREAM)
    attr_idx = ctypes.c_size_t(0)
    stream = p(torch.cuda.current_stream().cuda_stream)
    common = [
        p(dsts.data_ptr()),
        p(srcs.data_ptr()),
        p(sizes.data_ptr()),
        ctypes.c_size_t(dsts.numel()),
        ctypes.byref(attrs),
        ctypes.byref(attr_idx),
        ctypes.c_size_t(1),
    ]
    if version >= 13000:
        call = ctypes.CFUNCTYPE(
            ctypes.c_int, *([p] * 3), ctypes.c_size_t, p, p, ctypes.c_size_t, p
        )(fn)
        rc = call(*common, stream)
    else:
        fail = ctypes.c_size_t(0)
        call = ctypes.CFUNCTYPE(
            ctypes.c_int, *([p] * 3), ctypes.c_size_t, p, p, ctypes.c_size_t, p, p
        )(fn)
        rc = call(*common, ctypes.byref(fail), stream)
    if rc != 0:
        raise RuntimeError(f"stand-in kvcacheio: cudaMemcpyBatchAsync failed ({rc})")


def _use_batch() -> bool:
    return MODE == "batch" and _batch_function()[0] is not None


def copy_mode() -> str:
    """How the copies are issued in this process: ``batch``, ``2d`` or
    ``page`` (no CuPy)."""
    if _use_batch():
        return "batch"
    return "2d" if cupy else "page"


def h2d_entries(src, dst, src_indices, dst_indices, layer_id, page_size):
    """Per page: (dst address, src address, bytes) of the H2D op."""
    s = page_starts(src_indices, page_size) // page_size
    d = page_starts(dst_indices, page_size)
    n = equal_count(s, d)
    item = dst.element_size()
    width = dst[0].numel() * item * page_size
    src_base = src.data_ptr() + layer_id * src.stride(1) * src.element_size()
    srcs = src_base + s[:n] * (src.stride(0) * src.element_size())
    dsts = dst.data_ptr() + d[:n] * (dst.stride(0) * item)
    return dsts, srcs, torch.full((n,), width, dtype=torch.int64)


def d2h_entries(src_layers, dst, src_indices, dst_indices, page_size):
    """Per page and layer: (dst address, src address, bytes) of the D2H op."""
    s = page_starts(src_indices, page_size)
    d = page_starts(dst_indices, page_size) // page_size
    n = equal_count(s, d)
    item = dst.element_size()
    dsts, srcs = [], []
    for j, layer in enumerate(src_layers):
        row = layer.stride(0) * layer.element_size()
        srcs.append(layer.data_ptr() + s[:n] * row)
        dsts.append(
            dst.data_ptr() + j * dst.stride(1) * item + d[:n] * (dst.stride(0) * item)
        )
    width = src_layers[0][0].numel() * src_layers[0].element_size() * page_size
    dsts = torch.stack(dsts, 1).flatten()  # page-major, as the real op walks them
    srcs = torch.stack(srcs, 1).flatten()
    return dsts, srcs, torch.full((dsts.numel(),), width, dtype=torch.int64)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
):
    if _use_batch():
        for src, dst in zip(src_ptrs, dst_ptrs):
            _copy_batch(
                *h2d_entries(src, dst, src_indices, dst_indices, layer_id, page_size)
            )
        return
    runs = plan(src_indices, dst_indices, page_size, page_size, page_size)
    for src, dst in zip(src_ptrs, dst_ptrs):
        item = dst.element_size()
        width = dst[0].numel() * item * page_size
        if cupy is not None:
            # Addresses of dst[d] and src[p][layer_id] (both contiguous rows).
            dst_base, dst_row = dst.data_ptr(), dst.stride(0) * item
            src_pitch = src[0].numel() * src.element_size()
            src_base = src.data_ptr() + layer_id * src.stride(1) * src.element_size()
            for s, d, n in runs:
                p = s // page_size
                _copy2d(
                    dst_base + d * dst_row,
                    width,
                    src_base + p * src.stride(0) * src.element_size(),
                    src_pitch,
                    width,
                    n,
                )
        else:
            for s, d, n in runs:
                p = s // page_size
                for k in range(n):
                    dst[d + k * page_size : d + (k + 1) * page_size].copy_(
                        src[p + k][layer_id].reshape(dst[d : d + page_size].shape),
                        non_blocking=True,
                    )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, page_size
):
    layers = len(src_ptrs) // len(dst_ptrs)
    if _use_batch():
        for b, dst in enumerate(dst_ptrs):
            _copy_batch(
                *d2h_entries(
                    src_ptrs[b * layers : (b + 1) * layers],
                    dst,
                    src_indices,
                    dst_indices,
                    page_size,
                )
            )
        return
    runs = plan(src_indices, dst_indices, page_size, page_size, page_size)
    for b, dst in enumerate(dst_ptrs):
        item = dst.element_size()
        page_pitch = dst[0].numel() * item
        for j in range(layers):
            src = src_ptrs[b * layers + j]
            src_row = src.stride(0) * src.element_size()
            width = src[0].numel() * src.element_size() * page_size
            dst_base = dst.data_ptr() + j * dst.stride(1) * item
            for s, d, n in runs:
                p = d // page_size
                if cupy is not None:
                    # Addresses of dst[p][j] and src[s] (both contiguous rows).
                    _copy2d(
                        dst_base + p * dst.stride(0) * item,
                        page_pitch,
                        src.data_ptr() + s * src_row,
                        width,
                        width,
                        n,
                    )
                else:
                    for k in range(n):
                        dst[p + k][j][:page_size].copy_(
                            src[s + k * page_size : s + (k + 1) * page_size].reshape(
                                dst[p + k][j][:page_size].shape
                            ),
                            non_blocking=True,
                        )


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing_op(f"sgl_kernel.kvcacheio.{name}")
