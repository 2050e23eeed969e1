"""A record of the prefix rows every extend's attention reads, per TP rank.

Test-only instrumentation (not a stand-in: it computes nothing the server
uses).  In a CPU-server process started with ``SGLANG_TEST_LOAD_RECORD_DIR``
set, ``standins.cpu_server_standins`` wraps ``TorchNativeAttnBackend.forward_extend``:
for each request of the batch with a cached prefix it appends one JSON line
to ``DIR/rank<R>.jsonl`` with the layer, the prefix length and the SHA-256 of
the prefix's device rows, read through the pool's own accessors (which wait
for the layer's load-back, as the real read does):

* ``kv``: the KV (latent) rows of the prefix's token slots;
* ``index_k``: for a DSA pool, the index-K pages of those slots (keys and
  scales), which dense attention never reads, so equal outputs cannot prove
  them.

A prefix that came back from the host tier is thus recorded as the forward
sees it after the load-back (and, rank-sharded, after the owner's broadcast).
Two servers given the same sequential requests must write the same lines.

``DIR/batches-rank<R>.jsonl`` gets one line per forward (at layer 0): extend
or decode, each request's prefix and extend lengths, and under DP attention
every DP rank's token count (``global_num_tokens_cpu``). Bytes are equal
only between forwards of the same batches: on CPU a request sharing the
forward with another one (a leftover ``/health_generate`` of the start's
polling) changes its logits in the last bits, measured on the tiny MLA
DP-attention server: up to 0.004 in a logprob, whether the other request
runs on the same DP rank or the other one. So the tests compare these lines
before the bytes.

``recording_h2d`` also logs every host->device copy of the host pools (the
live benchmark's bytes per rank per load).

The negative controls: while ``DIR/corrupt-index-k`` (or ``DIR/corrupt-kv``)
exists, TP rank 0 zeroes the first host page of its next index-K (or KV)
load-back before the copy, and removes the file (``corrupting_h2d``
wraps the host pool's copy op).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ENV = "SGLANG_TEST_LOAD_RECORD_DIR"
# host pool module -> the trigger file its load-backs look for
TRIGGERS = {
    "sglang.srt.mem_cache.pool_host.dsa": "corrupt-index-k",
    "sglang.srt.mem_cache.pool_host.mla": "corrupt-kv",
}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _sha(t) -> str:
    import torch

    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def record_prefix_rows(backend, layer_id: int, forward_batch, directory: str) -> None:
    prefix_lens = forward_batch.extend_prefix_lens_cpu or []
    if not any(prefix_lens):
        return
    pool = backend.token_to_kv_pool
    kv = pool.get_key_buffer(layer_id)
    index_k = None  # a plain MLA pool has no index-K buffer
    if hasattr(pool, "get_index_k_with_scale_buffer") and getattr(
        pool, "use_dsa", True
    ):
        index_k = pool.get_index_k_with_scale_buffer(layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    lines = []
    for i, n in enumerate(prefix_lens):
        if not n:
            continue
        req = int(forward_batch.req_pool_indices[i])
        slots = req_to_token[req, :n].long()
        entry = {"layer": layer_id, "prefix": int(n), "kv": _sha(kv[slots])}
        if index_k is not None:
            page = index_k.shape[1] // (128 + 4)
            pages = slots[::page] // page
            entry["index_k"] = _sha(index_k[pages])
        lines.append(json.dumps(entry))
    path = Path(directory) / f"rank{_rank()}.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def record_batch(layer_id: int, forward_batch, directory: str) -> None:
    """One line per forward, at layer 0: what ran in it, on this rank and,
    under DP attention, on every DP rank."""
    if layer_id != 0:
        return
    entry = {"bs": int(forward_batch.batch_size)}
    if forward_batch.forward_mode.is_decode():
        entry["mode"] = "decode"
    else:
        entry["mode"] = "extend"
        entry["prefix"] = [int(n) for n in forward_batch.extend_prefix_lens_cpu or []]
        entry["extend"] = [int(n) for n in forward_batch.extend_seq_lens_cpu or []]
    if forward_batch.global_num_tokens_cpu is not None:
        entry["global"] = [int(n) for n in forward_batch.global_num_tokens_cpu]
    path = Path(directory) / f"batches-rank{_rank()}.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def recording_forward_extend(forward_extend, directory: str):
    def wrapped(self, q, k, v, layer, forward_batch, *args, **kwargs):
        record_batch(layer.layer_id, forward_batch, directory)
        record_prefix_rows(self, layer.layer_id, forward_batch, directory)
        return forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs)

    return wrapped


def recording_forward_decode(forward_decode, directory: str):
    def wrapped(self, q, k, v, layer, forward_batch, *args, **kwargs):
        record_batch(layer.layer_id, forward_batch, directory)
        return forward_decode(self, q, k, v, layer, forward_batch, *args, **kwargs)

    return wrapped


def corrupting_h2d(h2d, directory: str, trigger_name: str):
    """A host pool's ``transfer_kv_per_layer_direct_pf_lf`` that first zeroes
    one host page when the negative control asks for it."""

    def wrapped(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
        trigger = Path(directory) / trigger_name
        if _rank() == 0 and trigger.exists() and src_indices.numel():
            page = int(src_indices[0]) // page_size
            src_ptrs[0][page][layer_id].zero_()
            trigger.unlink()
        return h2d(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size)

    return wrapped


def recording_h2d(h2d, directory: str, pool: str):
    """A host pool's ``transfer_kv_per_layer_direct_pf_lf`` that appends what it
    copies host->device (pool, layer, pages, bytes) to ``DIR/h2d-rank<R>.jsonl``
    (the live benchmark's bytes per rank per load)."""

    def wrapped(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
        out = h2d(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size)
        pages = src_indices.numel() // page_size
        nbytes = pages * sum(src[0][0].numel() * src.element_size() for src in src_ptrs)
        entry = dict(pool=pool, layer=int(layer_id), pages=pages, bytes=nbytes)
        path = Path(directory) / f"h2d-rank{_rank()}.jsonl"
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        return out

    return wrapped


def read(
    directory: str | os.PathLike, ranks: int, prefix: str = "rank"
) -> list[list[dict]]:
    """Each rank's lines (``prefix`` ``rank``: the prefix rows; ``h2d-rank``:
    the host->device copies; ``batches-rank``: the forwards)."""
    out = []
    for r in range(ranks):
        path = Path(directory) / f"{prefix}{r}.jsonl"
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        out.append([json.loads(line) for line in text.splitlines() if line])
    return out
