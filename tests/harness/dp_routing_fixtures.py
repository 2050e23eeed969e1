"""Reference computations the cache-aware routing tests hold the product to.

``page_hash_digests`` and ``request_page_hashes`` compute the KV-event page
hashes of a request page by page (the tree's own chain, not the digest's
chunk chain), so a test can check that ``chunk_keys`` and the tracker start
from exactly the hashes a tree publishes. ``estimate_prefix_match`` is the
plain single-rank walk the router's one-walk-for-all-ranks
``estimate_prefix_matches`` must agree with (and the per-block overlap the
benchmark's Dynamo cost reads).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import sys
from array import array
from typing import Container, Optional, Sequence

UPSTREAM_TEST_MODULE = "sglang.test.dp_routing_fixtures"


@functools.cache
def _server_args_parser():
    """The real ServerArgs command line (argument errors raise, not exit)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def require_cache_aware_routing() -> None:
    """The first check of every cache-aware routing PR test, made before any
    of the PR's modules is imported: ``--load-balance-method cache_aware``
    parses on the real ServerArgs parser. Without the PR it fails by this
    assertion, not by an import error."""
    parser = _server_args_parser()
    argv = ["--model-path", "dummy", "--load-balance-method", "cache_aware"]
    try:
        method = parser.parse_args(argv).load_balance_method
    except argparse.ArgumentError as e:
        method = f"refused: {e}"
    if method != "cache_aware":
        raise AssertionError(
            f"--load-balance-method cache_aware does not parse ({method}): "
            "the cache-aware routing PR is missing"
        )


# Token ids at or above this value use the native wide-page encoding.
_U32_LIMIT = 1 << 32


def page_hash_digests(
    token_ids: Sequence[int], page_size: int, prior: Optional[bytes] = None
) -> list[bytes]:
    """Chained SHA-256 digests of every full page of ``token_ids``."""
    num_pages = len(token_ids) // page_size
    if num_pages == 0:
        return []
    tokens = token_ids[: num_pages * page_size]
    if not isinstance(tokens, array):
        tokens = array("q", tokens)
    if tokens and (min(tokens) < 0 or max(tokens) >= _U32_LIMIT):
        # Rare wide-token pages: defer to the tree's own hasher.
        from sglang.srt.mem_cache.utils import get_hash_str

        hexes = get_hash_str(
            array("q", tokens), prior.hex() if prior else None, page_size
        )
        return [bytes.fromhex(h) for h in hexes]
    words = array("I", tokens)
    if sys.byteorder != "little":
        words.byteswap()
    raw = words.tobytes()
    step = page_size * 4
    out = []
    sha256 = hashlib.sha256
    for start in range(0, len(raw), step):
        h = sha256(prior) if prior is not None else sha256()
        h.update(raw[start : start + step])
        prior = h.digest()
        out.append(prior)
    return out


def request_page_hashes(
    token_ids: Sequence[int], page_size: int, namespace
) -> list[int]:
    """Event hashes of the full pages of a request in ``namespace`` (a
    ``RequestNamespace``), as its tree would publish them."""
    from sglang.srt.disaggregation.kv_events import namespaced_block_hash
    from sglang.srt.managers.dp_routing.chunk_keys import (
        chain_seed,
        digest_to_event_hash,
        namespace_seed,
    )

    digests = page_hash_digests(token_ids, page_size, chain_seed(namespace.cache_salt))
    seed = namespace_seed(namespace.extra_key)
    return [
        namespaced_block_hash(digest_to_event_hash(d), namespace_seed=seed)
        for d in digests
    ]


def estimate_prefix_match(
    chunks,
    gpu: frozenset,
    host: frozenset,
    pending: Optional[Container] = None,
):
    """Longest chunk-aligned prefix of ``chunks`` (``RequestChunks``) present
    in one rank's sets, as a ``PrefixMatch``.

    The walk stops at the first chunk in neither set (nor in ``pending``:
    chunks dispatched to the rank and counted as GPU-resident), as a tree
    match stops at the first missing node. GPU length is the prefix up to the
    last chunk before the first non-GPU chunk.
    """
    from sglang.srt.managers.dp_routing.index import PrefixMatch

    gpu_len = total_len = 0
    on_gpu = True
    chunk_size = chunks.chunk_size
    for i, key in enumerate(chunks.keys):
        if key in gpu or (pending is not None and key in pending):
            if on_gpu:
                gpu_len = (i + 1) * chunk_size
        elif key in host:
            on_gpu = False
        else:
            break
        total_len = (i + 1) * chunk_size
    return PrefixMatch(gpu_len, total_len)
