"""HiCache L3 on a real Mooncake store, seen from the store and the server.

``MooncakeStore`` (``scripts/mooncake_store.py``, the one ``make serve-cpu
L3=mooncake`` starts) runs a master and a segment client on 127.0.0.1; the
helpers here read what servers put there, by the master's keys and object
sizes:

- a rank-sharded object (hicache-rank-shard) is
  ``{prefix}_{page hash}_rankshard-{rule}-tp{tp}-r{rank}_{kind}``;
- upstream's MLA object of a page (every layer, one per page shared by the
  TP ranks) is ``{prefix}_{page hash}__{kind}``;

where ``kind`` is ``k`` (KV) or ``indexer`` (the DSA indexer's pool) and
``prefix`` the backend's config prefix (the model path). Each server also
puts one ``sglang_mooncake_store_warmup_key...`` per rank at startup.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from harness.metrics import l3_counters

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
try:
    from mooncake_store import MooncakeStore  # noqa: E402,F401
finally:
    sys.path.pop(0)

SHARD_KEY = re.compile(r"^.*_([0-9a-f]{64})_rankshard-rr-tp2-r(\d)_(k|indexer)$")
REPLICATED_KEY = re.compile(r"^.*_([0-9a-f]{64})__(k|indexer)$")
WARMUP_KEY = re.compile(r"^sglang_mooncake_store_warmup_key[0-9a-f]+$")


def shard_of(key: str):
    """The shard rank of a rank-sharded key, None for an unsharded one."""
    m = SHARD_KEY.match(key)
    return int(m.group(2)) if m else None


def page_of(key: str) -> str:
    m = SHARD_KEY.match(key) or REPLICATED_KEY.match(key)
    return m.group(1)


def kind_of(key: str) -> str:
    m = SHARD_KEY.match(key) or REPLICATED_KEY.match(key)
    return m.groups()[-1]


def page_objects(keys: list[str], page_hash: str, kind: str) -> list[str]:
    """The objects (sharded or not) of one page and kind among ``keys``."""
    return [
        k
        for k in keys
        if (SHARD_KEY.match(k) or REPLICATED_KEY.match(k))
        and page_of(k) == page_hash
        and kind_of(k) == kind
    ]


def objects(store: MooncakeStore) -> dict:
    """The store's objects by who put them: ``sharded`` (rank -> {key:
    size}), ``replicated`` ({key: size}), ``warmup`` (keys) and ``other``
    (keys of no known form)."""
    keys = store.keys()
    sizes = store.sizes([k for k in keys if not WARMUP_KEY.match(k)])
    out = dict(sharded={0: {}, 1: {}}, replicated={}, warmup=[], other=[])
    for key in keys:
        if WARMUP_KEY.match(key):
            out["warmup"].append(key)
        elif SHARD_KEY.match(key):
            out["sharded"].setdefault(shard_of(key), {})[key] = sizes.get(key)
        elif REPLICATED_KEY.match(key):
            out["replicated"][key] = sizes.get(key)
        else:
            out["other"].append(key)
    return out


def shards_stored(shards: dict, pages, kinds) -> bool:
    """Every rank (0, 1) holds a shard object of every page hash in ``pages``
    and every kind in ``kinds`` (``shards``: ``objects()["sharded"]``)."""
    held = {(r, page_of(k), kind_of(k)) for r in (0, 1) for k in shards.get(r, {})}
    return all((r, p, k) in held for r in (0, 1) for p in pages for k in kinds)


def settled(
    server, store: MooncakeStore, timeout=60.0, base=None, pages=(), kinds=("k",)
) -> dict:
    """Waits until every rank's written-bytes counter equals the sizes of its
    shard objects in the store beyond ``base`` (rank -> bytes already there)
    and, with ``pages`` (page hashes), each rank's shard of each of them and
    each of ``kinds`` is there: the backups of the workload have landed (a
    poll before the first put lands sees the counters and the store alike
    unchanged, which ``pages`` rules out), at most ``timeout``; returns the
    last counters and objects (rank -> {key: size}) either way."""
    deadline = time.monotonic() + timeout
    while True:
        counters, shards = l3_counters(server), objects(store)["sharded"]
        grown = {
            r: sum(shards.get(r, {}).values()) - (base or {}).get(r, 0) for r in (0, 1)
        }
        if all(
            counters.get((r, "written")) == grown[r] for r in (0, 1)
        ) and shards_stored(shards, pages, kinds):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return dict(counters=counters, objects=shards)
