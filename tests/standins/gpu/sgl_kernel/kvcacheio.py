"""The two ``page_first_direct`` direct ops on CUDA tensors (test-only stand-in).

Semantics per page ``i`` (``ps`` = page size; see tests/standins/kvcacheio.py):
D2H ``dst[b][dst_idx[i*ps] // ps][j][:ps] = src[b*L + j][src_idx[i*ps] : +ps]``;
H2D ``dst[b][dst_idx[i*ps] : +ps] = src[b][src_idx[i*ps] // ps][layer_id]``.
Runs of consecutive pages are issued as one strided 2-D copy
(``cudaMemcpy2DAsync`` through CuPy when present) on the current stream,
otherwise one ``copy_`` per page. The runs come from ``page_runs.plan``,
memoized by index content, so the host cost per call stays near the real
op's (see ../README.md).
"""

import torch
from sgl_kernel import _missing
from sgl_kernel.page_runs import plan

try:
    import cupy
except ImportError:  # pragma: no cover
    cupy = None


def _copy2d(dst, dst_pitch, src, src_pitch, width, height):
    stream = torch.cuda.current_stream().cuda_stream
    cupy.cuda.runtime.memcpy2DAsync(
        dst, dst_pitch, src, src_pitch, width, height, 4, stream  # 4: default kind
    )


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
):
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
    runs = plan(src_indices, dst_indices, page_size, page_size, page_size)
    layers = len(src_ptrs) // len(dst_ptrs)
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
    return _missing(f"sgl_kernel.kvcacheio.{name}")
