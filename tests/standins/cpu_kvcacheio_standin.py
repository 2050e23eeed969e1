"""Torch stand-ins for the two ``sgl_kernel.kvcacheio`` direct ops of ``page_first_direct``.

The real ops (sgl-kernel ``csrc/kvcacheio/transfer.cu``) are CUDA-only, and the
host pool modules import them only under ``is_cuda() or is_hip()``.  Per page
``i`` (``ps`` = page_size, indices are token indices, one per token):

* ``transfer_kv_all_layer_direct_lf_pf`` (device layer-first -> host page-first,
  D2H): ``s = src_idx[i*ps]``, ``d = dst_idx[i*ps] // ps``; with ``L =
  len(src_ptrs) // len(dst_ptrs)`` layers per destination buffer ``b`` (MLA has
  one destination; MHA passes K layers then V layers and ``[k, v]``):
  ``dst_ptrs[b][d][j][:ps] = src_ptrs[b*L + j][s:s+ps]``.
* ``transfer_kv_per_layer_direct_pf_lf`` (host page-first -> device layer-first,
  H2D): ``s = src_idx[i*ps]``, ``d = dst_idx[i*ps]``;
  ``dst_ptrs[b][d:d+ps] = src_ptrs[b][s // ps][layer_id]``.

Every call can be recorded (``TRACE``) with the op, the tensors' data pointers,
the layer, the page indices and the bytes copied, so a test can compare the
transfer calls of two runs.
"""

from __future__ import annotations

import torch

UPSTREAM_TEST_MODULE = "sglang.test.cpu_kvcacheio_standin"

TRACE: list[dict] | None = None


def start_trace() -> list[dict]:
    global TRACE
    TRACE = []
    return TRACE


def stop_trace() -> list[dict]:
    global TRACE
    trace, TRACE = TRACE or [], None
    return trace


def _paired_pages(src_indices, dst_indices, page_size):
    """Both index lists as pages; sgl-kernel's ops ``TORCH_CHECK`` that the two
    hold the same number of indices, so a mismatch raises here too."""
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"stand-in kvcacheio: {src_indices.numel()} source and "
            f"{dst_indices.numel()} destination indices (the kernel requires equal counts)"
        )
    return _pages(src_indices, page_size), _pages(dst_indices, page_size)


def _pages(indices: torch.Tensor, page_size: int) -> list[int]:
    idx = indices.detach().to("cpu", torch.int64)
    if idx.numel() % page_size:
        raise ValueError(
            f"stand-in kvcacheio: {idx.numel()} indices are not whole pages of {page_size}"
        )
    return idx[::page_size].tolist()


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, page_size
):
    src_pages, dst_pages = _paired_pages(src_indices, dst_indices, page_size)
    layers = len(src_ptrs) // len(dst_ptrs)
    nbytes = 0
    for s, d in zip(src_pages, dst_pages):
        d //= page_size
        for b, dst in enumerate(dst_ptrs):
            for j in range(layers):
                src = src_ptrs[b * layers + j][s : s + page_size]
                dst[d][j][:page_size].copy_(src.reshape(dst[d][j][:page_size].shape))
                nbytes += src.numel() * src.element_size()
    if TRACE is not None:
        TRACE.append(
            dict(
                op="d2h_all_layer",
                dst=tuple(t.data_ptr() for t in dst_ptrs),
                src=tuple(t.data_ptr() for t in src_ptrs),
                layer=None,
                src_pages=tuple(src_pages),
                dst_pages=tuple(dst_pages),
                nbytes=nbytes,
            )
        )


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size
):
    src_pages, dst_pages = _paired_pages(src_indices, dst_indices, page_size)
    nbytes = 0
    for s, d in zip(src_pages, dst_pages):
        for src, dst in zip(src_ptrs, dst_ptrs):
            chunk = src[s // page_size][layer_id]
            dst[d : d + page_size].copy_(chunk.reshape(dst[d : d + page_size].shape))
            nbytes += chunk.numel() * chunk.element_size()
    if TRACE is not None:
        TRACE.append(
            dict(
                op="h2d_layer",
                dst=tuple(t.data_ptr() for t in dst_ptrs),
                src=tuple(t.data_ptr() for t in src_ptrs),
                layer=int(layer_id),
                src_pages=tuple(src_pages),
                dst_pages=tuple(dst_pages),
                nbytes=nbytes,
            )
        )


def install() -> None:
    """Bind the stand-ins where the MLA and DSA host pools look them up."""
    from sglang.srt.mem_cache.pool_host import dsa, mla

    for module in (mla, dsa):
        module.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
        module.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
