"""CPU stand-ins for the DeepSeek-V3.2 (DSA) pieces 0.5.23 runs only on GPUs.

Bound by ``standins.cpu_server_standins`` into a CPU server's processes (live tests and
``make serve-cpu``) when the modules below are imported; nowhere else.

* ``device_capability_while``: ``arg_groups/model_hook.py``
  ``handle_model_specific_adjustments`` and the DSA post-process passes it runs
  (KV-cache dtype, split backends) call ``torch.cuda.get_device_capability()``
  for a DSA model; on a CPU torch that stops the server before any worker
  starts ("Torch not compiled with CUDA enabled").  The wrapper answers SM90
  (bfloat16 KV, the Hopper choices) while that hook runs, and only then.
* ``indexer_forward_native``: ``Indexer.forward_native`` raises in 0.5.23 (no
  pure-torch path).  The stand-in computes the index K as the non-fused CUDA
  path does (``wk``, ``k_norm``, rope, Hadamard, fp8 e4m3 in blocks of 128 with
  power-of-two scales), stores it through the pool's own
  ``set_index_k_scale_buffer`` (so rank shard and HiCache see the real writes)
  and returns ``None``: dense attention, which is what DSA computes while every
  sequence is at most ``index_topk`` tokens.  Past that it raises: the sparse
  top-k selection needs the real indexer kernels.
* ``set_k_and_s``: the index-K store (``dsa_index_k_cache.SetKAndS``) is a triton
  kernel; the stand-in writes the same page layout in torch and checks the
  kernel's argument contract (its asserts) first.
* ``hadamard_transform``: the Hadamard rotation is a CUDA JIT kernel; the
  stand-in multiplies by the Sylvester Hadamard matrix.
"""

from __future__ import annotations

import functools

import torch

SM90 = (9, 0)
FP8_MAX = 448.0


def device_capability_while(hook):
    """``hook`` with ``torch.cuda.get_device_capability`` answering SM90."""

    @functools.wraps(hook)
    def wrapped(*args, **kwargs):
        real = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda device=None: SM90
        try:
            return hook(*args, **kwargs)
        finally:
            torch.cuda.get_device_capability = real

    return wrapped


@functools.lru_cache(maxsize=8)
def _sylvester(n: int) -> torch.Tensor:
    if n < 1 or n & (n - 1):
        raise ValueError(f"stand-in Hadamard: size {n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x @ H * scale`` over the last dimension (H symmetric, Sylvester order)."""
    h = _sylvester(x.shape[-1]).to(x.device)
    return (x.float() @ h * scale).to(x.dtype)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    return hadamard_transform(x, scale=x.size(-1) ** -0.5)


def act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt=None):
    """Block-wise fp8 e4m3 quantization as ``act_quant_triton.act_quant``:
    per row and block, ``amax`` floored at 1e-4, scale ``amax / 448`` (rounded
    up to a power of two when ``scale_fmt`` is set), ``y = clamp(x / scale)``."""
    if not x.is_contiguous() or x.size(-1) % block_size:
        raise ValueError(
            f"stand-in act_quant: needs a contiguous input whose last dimension "
            f"divides into blocks of {block_size}; got {tuple(x.shape)}"
        )
    blocks = x.float().reshape(*x.shape[:-1], x.size(-1) // block_size, block_size)
    amax = blocks.abs().amax(-1).clamp_min(1e-4)
    scale = amax / FP8_MAX
    if scale_fmt is not None:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    y = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return y.reshape(x.shape).to(torch.float8_e4m3fn), scale


def set_k_and_s(cls, pool, buf, loc, index_k, index_k_scale):
    """``SetKAndS.triton``: token ``t`` goes to page ``loc // ps``, slot
    ``loc % ps``; the page holds ``ps`` rows of 128 fp8 bytes, then ``ps`` fp32
    scales."""
    page_size = pool.index_page_size
    n = loc.shape[0]
    scale = index_k_scale.reshape(-1)
    contract = (
        buf.dtype == torch.uint8
        and buf.dim() == 2
        and buf.shape[1] == page_size * (128 + 4)
        and index_k.dtype == torch.float8_e4m3fn
        and tuple(index_k.shape) == (n, 128)
        and index_k_scale.dtype == torch.float32
        and index_k_scale.dim() in (1, 2)
        and scale.shape[0] == n
        and loc.dim() == 1
        and loc.dtype in (torch.int32, torch.int64)
        and buf.is_contiguous()
        and index_k.is_contiguous()
        and index_k_scale.is_contiguous()
    )
    if not contract:
        raise ValueError(
            "stand-in SetKAndS: arguments outside the kernel's contract: "
            f"buf {buf.dtype}{tuple(buf.shape)}, loc {loc.dtype}{tuple(loc.shape)}, "
            f"index_k {index_k.dtype}{tuple(index_k.shape)}, "
            f"scale {index_k_scale.dtype}{tuple(index_k_scale.shape)}, page {page_size}"
        )
    loc = loc.to(torch.int64)
    page, slot = loc // page_size, loc % page_size
    if n and int(page.max()) >= buf.shape[0]:
        raise IndexError("stand-in SetKAndS: a token slot past the index-K pool")
    flat = buf.view(-1)
    row = buf.shape[1]
    k_at = (page * row + slot * 128)[:, None] + torch.arange(128)
    flat[k_at.reshape(-1)] = index_k.view(torch.uint8).reshape(-1)
    s_at = (page * row + page_size * 128 + slot * 4)[:, None] + torch.arange(4)
    flat[s_at.reshape(-1)] = scale.contiguous().view(torch.uint8).reshape(-1)


def _index_key(indexer, x, positions):
    """``Indexer._get_k_bf16`` (the non-fused path): ``wk``, ``k_norm``, rope on
    the first ``rope_head_dim`` features, Hadamard.  The CPU rotary takes
    ``[tokens, heads, dim]`` (2-D input broadcasts wrongly there), so the rope
    part goes through it as one head."""
    key, _ = indexer.wk(x)
    key = indexer.k_norm(key)
    rope = indexer.rope_head_dim
    k_rope = key[..., :rope].unsqueeze(1).contiguous()
    _, k_rope = indexer.rotary_emb(positions, torch.empty_like(k_rope), k_rope)
    key = torch.cat(
        [k_rope.reshape(key.shape[0], rope).to(key.dtype), key[..., rope:]], -1
    )
    return rotate_activation(key)


def indexer_forward_native(
    self,
    x,
    q_lora,
    positions,
    forward_batch,
    layer_id,
    return_indices=True,
    use_cuda_graph=True,
):
    mode = forward_batch.forward_mode
    if not (mode.is_extend_without_speculative() or mode.is_decode_or_idle()):
        raise NotImplementedError(
            f"stand-in DSA indexer: forward mode {mode} needs the real indexer"
        )
    # The real indexer skips its top-k (every token selected) only where it
    # knows every sequence is at most index_topk long: from seq_lens_cpu, else
    # seq_lens; with neither it runs the full selection.
    longest = None
    for seq_lens in (forward_batch.seq_lens_cpu, forward_batch.seq_lens):
        if seq_lens is not None and seq_lens.numel():
            longest = int(seq_lens.max())
            break
    if longest is None and not mode.is_idle():
        raise NotImplementedError(
            "stand-in DSA indexer: no sequence lengths (seq_lens_cpu and seq_lens "
            "empty); the real indexer would run its sparse top-k selection"
        )
    if longest is not None and longest > self.index_topk:
        raise NotImplementedError(
            f"stand-in DSA indexer: a {longest}-token sequence exceeds "
            f"index_topk={self.index_topk}; the sparse top-k selection needs "
            "the real indexer kernels"
        )
    if getattr(self, "use_dsa_indexer_fusion", False):
        raise NotImplementedError("stand-in DSA indexer: fused K path (CUDA only)")
    key = _index_key(self, x, positions)
    self._store_index_k_cache(
        forward_batch=forward_batch,
        layer_id=layer_id,
        key=key.contiguous(),
        act_quant=act_quant,
    )
    return None  # every token selected: dense attention
