"""The two ``page_first_direct`` direct ops on CUDA tensors (test-only stand-in).

Semantics per page ``i`` (``ps`` = page size; see tests/standins/kvcacheio.py):
D2H ``dst[b][dst_idx[i*ps] // ps][j][:ps] = src[b*L + j][src_idx[i*ps] : +ps]``;
H2D ``dst[b][dst_idx[i*ps] : +ps] = src[b][src_idx[i*ps] // ps][layer_id]``.
Runs of consecutive pages are issued as one strided 2-D copy
(``cudaMemcpy2DAsync`` through CuPy when present) on the current stream,
otherwise one ``copy_`` per page.
"""

import torch
from sgl_kernel import _missing

try:
    import cupy
except ImportError:  # pragma: no cover
    cupy = None


def _pages(indices, page_size):
    idx = indices.detach().to("cpu", torch.int64)
    return idx[::page_size].tolist()


def _runs(src_pages, dst_pages, src_step, dst_step):
    """Group page pairs into runs that are consecutive on both sides."""
    runs = []
    for s, d in zip(src_pages, dst_pages):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n * src_step and d == d0 + n * dst_step:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def _copy2d(dst, dst_pitch, src, src_pitch, width, height):
    stream = torch.cuda.current_stream().cuda_stream
    cupy.cuda.runtime.memcpy2DAsync(
        dst, dst_pitch, src, src_pitch, width, height, 4, stream  # 4: default kind
    )


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
):
    src_pages = _pages(src_indices, page_size)
    dst_pages = _pages(dst_indices, page_size)
    for src, dst in zip(src_ptrs, dst_ptrs):
        row = dst[0].numel() * dst.element_size()
        width = row * page_size
        for s, d, n in _runs(src_pages, dst_pages, page_size, page_size):
            p = s // page_size
            if cupy is not None:
                _copy2d(
                    dst[d].data_ptr(),
                    width,
                    src[p][layer_id].data_ptr(),
                    src[0].numel() * src.element_size(),
                    width,
                    n,
                )
            else:
                for k in range(n):
                    dst[d + k * page_size : d + (k + 1) * page_size].copy_(
                        src[p + k][layer_id].reshape(dst[d : d + page_size].shape),
                        non_blocking=True,
                    )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, page_size
):
    src_pages = _pages(src_indices, page_size)
    dst_pages = _pages(dst_indices, page_size)
    layers = len(src_ptrs) // len(dst_ptrs)
    for b, dst in enumerate(dst_ptrs):
        page_pitch = dst[0].numel() * dst.element_size()
        for j in range(layers):
            src = src_ptrs[b * layers + j]
            width = src[0].numel() * src.element_size() * page_size
            for s, d, n in _runs(src_pages, dst_pages, page_size, page_size):
                p = d // page_size
                if cupy is not None:
                    _copy2d(
                        dst[p][j].data_ptr(),
                        page_pitch,
                        src[s].data_ptr(),
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
    return _missing(f"sgl_kernel.kvcacheio.{name}")
