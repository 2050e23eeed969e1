"""The rank-sharded host tier with L3 on a real Mooncake store, on live TP=2 CPU
servers: L3 bytes per rank and restore time, sharded against replicated and
against 0.5.23 itself, and the same geometry's projection for DeepSeek-V3 /
V3.2 at TP=4 and TP=8.

For each model (``tiny-mla``: DeepSeek-V3, plain MLA, page size 1; ``tiny-dsa``:
DeepSeek-V3.2, MLA + DSA indexer, page size 64) and each server (our wheel
with ``SGLANG_ENABLE_HICACHE_RANK_SHARD=1``, the same wheel with it unset, and
the pristine 0.5.23 wheel), ``sglang serve`` runs at ``--tp 2`` with HiCache
(1024-token device pool, ``--hicache-ratio 2``, direct io,
``page_first_direct``; ``harness.live_server``, 127.0.0.1 only) and
``--hicache-write-policy write_through --hicache-storage-prefetch-policy
wait_complete`` on a fresh Mooncake store (``scripts/mooncake_store.py``: a
master and a segment client, ``--hicache-storage-backend mooncake``; with
``--backend file`` a fresh directory instead). A first server sends
``--prompts`` greedy prompts of ``--words`` tokens and stops once its pages
are in the store; a second one, started on the same store, sends them again:
each revisit is served from L3 (``cached_tokens_details`` storage).

Reported per model, server and rank: L3 bytes written (first server) and read
(second server), the revisits' storage tokens, and the restore time (the
revisits' mean wall time per request, L3 -> host -> device and the prefill of
the unaligned tail), each with its ratio to the replicated server of the same
run. The sharded server's bytes are its counters
(``sglang:hicache_rank_shard_l3_bytes_total`` in /metrics), checked against
the sizes of its shard objects in the store; upstream has no per-rank
counter, so the others' come from their objects in the store and upstream's
rule: rank 0 writes each whole page once, every rank reads each whole page it
hits. The projection applies each rule to DeepSeek-V3 (61 layers + 1 packed
NextN layer, 576 bf16 per token and layer) and V3.2 (the same, plus a
132-byte indexer row per token and layer), page 64. The table is printed; the
JSON (run metadata with the git revision and series label, the parameters,
summaries, projection and per-request records) and a PNG go to ``--out``
(default ``results/``; one folder per run).

Run: ``.venv/bin/python -m benchmark.hicache_rank_shard.bench_l3_rank_shard``
(twelve server starts, about 15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmark.bench_meta import run_dir, run_metadata
from harness import mooncake_l3
from harness.live_server import HICACHE_ARGS, LiveServer, assert_all_gone
from harness.metrics import l3_counters

HERE = Path(__file__).resolve().parent

TP, DEVICE_TOKENS, RATIO = 2, 1024, 2
MODELS = ["tiny-mla", "tiny-dsa"]
PAGE = {"tiny-mla": 1, "tiny-dsa": 64}
# name: (wheel, environment)
SERVERS = {
    "sharded": ("patched", {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "1"}),
    "replicated": ("patched", {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "0"}),
    "0.5.23": ("upstream", {}),
}
BACKENDS = ("mooncake", "file")
STORE_SEGMENT = "512 MB"
L3_ARGS = [
    "--hicache-write-policy",
    "write_through",
    "--hicache-storage-prefetch-policy",
    "wait_complete",
    "--enable-metrics",
]
METRIC = "sglang:hicache_rank_shard_l3_bytes_total"
SHARD_FILE = re.compile(r"_rankshard-rr-tp\d+-r(\d+)\.bin$")
WORDS = "cache prefix token rank host device page layer tree radix decode".split()

# DeepSeek-V3 / V3.2 (config.json): 61 layers, 1 NextN layer packed into the
# host pools when MTP runs, kv_lora_rank 512 + qk_rope_head_dim 64 in bf16;
# V3.2's indexer: index_head_dim 128 in fp8 + a 4-byte scale per token.
PROJECTION_MODELS = {
    "DeepSeek-V3": dict(layers=61, drafts=1, kv_row=576 * 2, indexer_row=0),
    "DeepSeek-V3.2": dict(layers=61, drafts=1, kv_row=576 * 2, indexer_row=132),
}
PROJECTION_PAGE = 64


def server_args(l3: list[str]) -> list[str]:
    args = ["--tp", str(TP), "--max-total-tokens", str(DEVICE_TOKENS)]
    return args + HICACHE_ARGS + ["--hicache-ratio", str(RATIO)] + L3_ARGS + l3


def counters(server) -> dict:
    """``<direction>_r<tp rank>`` -> bytes of the L3 counter
    (``harness.metrics.l3_counters``, as the live tests read it)."""
    return {f"{d}_r{rank}": n for (rank, d), n in l3_counters(server).items()}


def disk(storage_dir: str) -> dict:
    """Bytes of the objects on disk: in all, per shard rank (sharded), and one
    page's object of each kind (KV, DSA indexer) per rank or in all."""
    out = {"all": 0, "object": {}}
    for name in os.listdir(storage_dir):
        if not name.endswith(".bin"):
            continue
        size = os.path.getsize(Path(storage_dir) / name)
        out["all"] += size
        m = SHARD_FILE.search(name)
        owner = f"r{m.group(1)}" if m else "all"
        if m:
            out[owner] = out.get(owner, 0) + size
        kind = "indexer" if ".indexer_" in name else "kv"
        out["object"][f"{owner}.{kind}"] = size
    return out


def store_bytes(store) -> dict:
    """The Mooncake store's objects, shaped as ``disk`` shapes the file
    backend's: bytes in all, per shard rank (sharded), and one page's object
    of each kind per rank or in all."""
    objs = mooncake_l3.objects(store)
    out = {"all": 0, "object": {}}
    for rank, keys in objs["sharded"].items():
        for key, size in keys.items():
            out["all"] += size
            out[f"r{rank}"] = out.get(f"r{rank}", 0) + size
            out["object"][f"r{rank}.{mooncake_l3.kind_of(key)}"] = size
    for key, size in objs["replicated"].items():
        out["all"] += size
        kind = "kv" if mooncake_l3.kind_of(key) == "k" else "indexer"
        out["object"][f"all.{kind}"] = size
    return out


class L3:
    """The L3 of one (model, server) run: a fresh Mooncake store or file
    directory; ``args`` and ``env`` point a server at it, ``bytes()`` reads
    what it holds."""

    def __init__(self, backend: str, label: str):
        self.backend = backend
        self.store = self.dir = None
        if backend == "mooncake":
            self.store = mooncake_l3.MooncakeStore(segment=STORE_SEGMENT)
            self.args, self.env = self.store.server_args(), {}
        else:
            self.dir = tempfile.mkdtemp(prefix=f"bench-l3-rank-shard-{label}-")
            self.args = ["--hicache-storage-backend", "file"]
            self.env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": self.dir}

    def bytes(self) -> dict:
        return store_bytes(self.store) if self.store else disk(self.dir)

    def stats(self) -> dict | None:
        return self.store.stats() if self.store else None

    def close(self) -> None:
        if self.store:
            held = self.store.stop()["held_ports"]
            assert not held, f"the Mooncake store's ports still held: {held}"
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def settled(server, l3: L3, sharded: bool, timeout: float = 120.0):
    """Waits until the L3 objects stop growing between two polls (and,
    sharded, every rank's written counter equals its bytes in L3)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        now = l3.bytes()
        ok = now == last
        if sharded:
            c = counters(server)
            ok = ok and all(c.get(f"written_r{r}") == now.get(f"r{r}") for r in (0, 1))
        if ok:
            return now
        last = now
        time.sleep(1.0)
    return last


def one(server, text: str) -> dict:
    t0 = time.monotonic()
    r = server.generate(
        {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    )
    meta = r["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return dict(
        seconds=time.monotonic() - t0,
        prompt=meta["prompt_tokens"],
        cached=meta["cached_tokens"],
        storage=details.get("storage", 0),
        output_ids=r["output_ids"],
    )


def run_server(model: str, name: str, args) -> dict:
    tree, env = SERVERS[name]
    rng = random.Random(args.seed)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(args.words))
        for _ in range(args.prompts)
    ]
    sharded = name == "sharded"
    l3 = L3(args.backend, f"{model}-{name}")
    env = {**env, **l3.env}
    try:
        server = LiveServer(tree, server_args(l3.args), env=env, name=name, model=model)
        try:
            first = [one(server, t) for t in texts]
            on_disk = settled(server, l3, sharded)
            first_counters = counters(server) if sharded else {}
        finally:
            assert_all_gone(server.stop())
        server = LiveServer(tree, server_args(l3.args), env=env, name=name, model=model)
        try:
            revisits = [one(server, t) for t in texts]
            restart_counters = counters(server) if sharded else {}
        finally:
            assert_all_gone(server.stop())
        store_stats = l3.stats()
    finally:
        l3.close()
    page = PAGE[model]
    stored_pages = sum(r["storage"] for r in revisits) // page
    ranks = []
    for rank in range(TP):
        if sharded:
            written = first_counters.get(f"written_r{rank}", 0)
            read = restart_counters.get(f"read_r{rank}", 0)
            source = "counter"
        else:
            # upstream: rank 0 writes each whole page once; every rank reads
            # the whole object of every page it hits
            whole = sum(v for k, v in on_disk["object"].items() if k.startswith("all."))
            written = on_disk["all"] if rank == 0 else 0
            read = stored_pages * whole
            source = "disk + upstream rule"
        if sharded:
            # the counter against the store's own sizes of this rank's objects
            assert written == on_disk.get(f"r{rank}"), (rank, written, on_disk)
        ranks.append(dict(rank=rank, written=written, read=read, source=source))
    return dict(
        model=model,
        server=name,
        backend=args.backend,
        page=page,
        on_disk=on_disk,
        store_stats=store_stats,
        stored_pages=stored_pages,
        storage_tokens=sum(r["storage"] for r in revisits),
        restore_s=sum(r["seconds"] for r in revisits) / len(revisits),
        cold_s=sum(r["seconds"] for r in first) / len(first),
        ranks=ranks,
        first=first,
        revisits=revisits,
    )


def same_outputs(runs: list[dict], run: dict) -> bool | None:
    """The revisits' outputs equal the replicated server's of the same run."""
    base = [
        r for r in runs if r["model"] == run["model"] and r["server"] == "replicated"
    ]
    if not base:
        return None
    return [r["output_ids"] for r in run["revisits"]] == [
        r["output_ids"] for r in base[0]["revisits"]
    ]


def projection() -> list[dict]:
    rows = []
    page = PROJECTION_PAGE
    for model, g in PROJECTION_MODELS.items():
        row = g["kv_row"] + g["indexer_row"]
        whole = (g["layers"] + g["drafts"]) * row * page
        for tp in (4, 8):
            owned = [
                len(range(r, g["layers"], tp)) + g["drafts"] for r in range(tp)
            ]  # the j-th layer -> rank j % tp, drafts on every rank
            shard = [n * row * page for n in owned]
            rows.append(
                dict(
                    model=model,
                    tp=tp,
                    page_tokens=page,
                    replicated_write_rank0=whole,
                    replicated_write_total=whole,
                    replicated_read_per_rank=whole,
                    replicated_read_total=tp * whole,
                    sharded_per_rank_max=max(shard),
                    sharded_per_rank_min=min(shard),
                    sharded_total=sum(shard),
                    read_total_ratio=sum(shard) / (tp * whole),
                    read_per_rank_ratio=max(shard) / whole,
                )
            )
    return rows


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for model in sorted({r["model"] for r in runs}):
        by = {r["server"]: r for r in runs if r["model"] == model}
        base = by.get("replicated")
        for name in ("0.5.23", "replicated", "sharded"):
            run = by.get(name)
            if run is None:
                continue
            for rank in run["ranks"]:
                ref = base["ranks"][rank["rank"]] if base else None

                def ratio(key, rank=rank, ref=ref):
                    if not ref or not ref[key] or rank[key] is None:
                        return None
                    return rank[key] / ref[key]

                rows.append(
                    dict(
                        model=model,
                        server=name,
                        rank=rank["rank"],
                        source=rank["source"],
                        storage_tokens=run["storage_tokens"],
                        written=rank["written"],
                        read=rank["read"],
                        written_vs_replicated=ratio("written"),
                        read_vs_replicated=ratio("read"),
                        restore_s=run["restore_s"],
                        restore_vs_replicated=(
                            run["restore_s"] / base["restore_s"] if base else None
                        ),
                        same_outputs=same_outputs(runs, run),
                    )
                )
    return rows


def ratios_vs_replicated(rows: list[dict]) -> dict:
    """The sharded server's figures over the replicated server's of the same
    run: L3 bytes read per rank, L3 bytes written in all, restore time."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        sh = [r for r in mine if r["server"] == "sharded"]
        rep = [r for r in mine if r["server"] == "replicated"]
        if not sh or not rep:
            continue
        for r in sh:
            if r["read_vs_replicated"] is not None:
                out[f"{model} L3 read r{r['rank']}"] = r["read_vs_replicated"]
        written = sum(r["written"] for r in rep)
        if written:
            out[f"{model} L3 written"] = sum(r["written"] for r in sh) / written
        out[f"{model} restore"] = sh[0]["restore_vs_replicated"]
    return {k: round(v, 4) for k, v in out.items() if v is not None}


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_tables(rows: list[dict], proj: list[dict]) -> None:
    head = (
        f"{'model':9} {'server':10} {'rank':>4} {'storage tok':>11} "
        f"{'L3 written':>11} {'vs repl':>7} {'L3 read':>11} {'vs repl':>7} "
        f"{'restore s':>9} {'vs repl':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['model']:9} {r['server']:10} {r['rank']:>4} {r['storage_tokens']:>11} "
            f"{r['written']:>11} {fmt(r['written_vs_replicated'], '.3f'):>7} "
            f"{fmt(r['read'], 'd'):>11} {fmt(r['read_vs_replicated'], '.3f'):>7} "
            f"{r['restore_s']:>9.3f} {fmt(r['restore_vs_replicated'], '.3f'):>7}"
        )
    print()
    head = (
        f"{'projection':14} {'tp':>2} {'repl read/rank':>14} {'repl read tot':>13} "
        f"{'shard/rank max':>14} {'shard tot':>10} {'tot ratio':>9}"
    )
    print(head)
    print("-" * len(head))
    for p in proj:
        print(
            f"{p['model']:14} {p['tp']:>2} {p['replicated_read_per_rank'] / 1e6:>11.2f} MB "
            f"{p['replicated_read_total'] / 1e6:>10.2f} MB "
            f"{p['sharded_per_rank_max'] / 1e6:>11.2f} MB {p['sharded_total'] / 1e6:>7.2f} MB "
            f"{p['read_total_ratio']:>9.3f}"
        )


def plot(rows: list[dict], proj: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    labels = [f"{r['model']}\n{r['server']} r{r['rank']}" for r in rows]
    palette = {"0.5.23": "tab:orange", "replicated": "tab:gray", "sharded": "tab:blue"}
    colors = [palette[r["server"]] for r in rows]
    axes[0].bar(labels, [r["read"] or 0 for r in rows], color=colors)
    axes[0].set_title("L3 bytes read per rank (restart revisits)")
    axes[1].bar(labels, [r["written"] for r in rows], color=colors)
    axes[1].set_title("L3 bytes written per rank")
    plabels = [f"{p['model']}\nTP={p['tp']}" for p in proj]
    x = range(len(proj))
    axes[2].bar(
        [i - 0.2 for i in x],
        [p["replicated_read_total"] / 1e6 for p in proj],
        width=0.4,
        color="tab:gray",
        label="replicated",
    )
    axes[2].bar(
        [i + 0.2 for i in x],
        [p["sharded_total"] / 1e6 for p in proj],
        width=0.4,
        color="tab:blue",
        label="sharded",
    )
    axes[2].set_xticks(list(x), plabels)
    axes[2].set_title("projection: L3 MB read per 64-token page, all ranks")
    axes[2].legend()
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelsize=7, rotation=90)
    axes[2].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="mooncake")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    runs = []
    for model in args.models:
        for name in args.servers:
            runs.append(run_server(model, name, args))
    rows = summarize(runs)
    proj = projection()
    print_tables(rows, proj)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = run_dir(args.out, f"l3-rank-shard-{args.backend}") / "bench_l3_rank_shard"
    meta = run_metadata()
    data = dict(
        **meta,
        series=meta["series_label"],
        params=dict(
            tp=TP,
            device_tokens=DEVICE_TOKENS,
            hicache_ratio=RATIO,
            prompts=args.prompts,
            words=args.words,
            seed=args.seed,
            l3_args=L3_ARGS,
            backend=args.backend,
            store_segment=STORE_SEGMENT if args.backend == "mooncake" else None,
        ),
        summary=rows,
        ratio_vs_replicated=ratios_vs_replicated(rows),
        projection=proj,
        runs=runs,
    )
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    plot(rows, proj, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
