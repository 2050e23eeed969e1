"""The rank-sharded host tier on live TP=2 CPU servers: host capacity and the
host->device bytes each rank copies per load-back, sharded against replicated.

For each model (``tiny-mla``: DeepSeek-V3, plain MLA; ``tiny-dsa``:
DeepSeek-V3.2, MLA + DSA indexer) this starts the installed wheel's ``sglang
serve`` twice at ``--tp 2`` with HiCache (1024-token device pool, ``--hicache-ratio
2``, direct io, ``page_first_direct``; ``harness.live_server``, 127.0.0.1 only):
with ``SGLANG_ENABLE_HICACHE_RANK_SHARD=1`` and with it unset. Each gets the same
greedy workload: ``--prompts`` prompts of ``--words`` tokens (more than the device
pool holds), then each again, so every revisit whose prefix is still in host
memory is loaded back.  ``harness.load_record`` logs every host->device copy of
the host pools per rank (pool, host layer index, pages, bytes).

Reported per model and server: host pool tokens (from the server log), host hits
and host-hit tokens of the revisits, load-back copies and bytes per rank, bytes
per rank per loaded token, and the sharded / replicated ratio of the latter (the
geometry says 1/2 at TP=2 with 4 layers: each rank copies only the layers it
owns; the rest arrive in the owner's broadcast).  The table is printed; the JSON
(run metadata with the git revision and series label, the parameters, summaries
and per-request records) and a PNG go to ``--out`` (default ``results/``; one folder per run).

Run: ``.venv/bin/python -m benchmark.hicache_rank_shard.bench_live_rank_shard``
(two pairs of server starts, a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from benchmark.bench_meta import run_dir, run_metadata
from harness import load_record
from harness.live_server import HICACHE_ARGS, LiveServer, assert_all_gone

HERE = Path(__file__).resolve().parent


TP, DEVICE_TOKENS, RATIO = 2, 1024, 2
MODELS = ["tiny-mla", "tiny-dsa"]
SERVERS = {
    "sharded": {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "1"},
    "replicated": {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "0"},
}
WORDS = "cache prefix token rank host device page layer tree radix decode".split()


def run_server(model: str, name: str, args) -> dict:
    record_dir = tempfile.mkdtemp(prefix=f"bench-live-rank-shard-{name}-")
    env = dict(SERVERS[name], **{load_record.ENV: record_dir})
    server_args = ["--tp", str(TP), "--max-total-tokens", str(DEVICE_TOKENS)]
    server_args += HICACHE_ARGS + ["--hicache-ratio", str(RATIO)]
    server = LiveServer("patched", server_args, env=env, name=name, model=model)
    rng = random.Random(args.seed)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(args.words))
        for _ in range(args.prompts)
    ]
    requests = []
    try:
        for phase, batch in (
            ("first", texts),
            ("revisit", [t + " again" for t in texts]),
        ):
            for text in batch:
                t0 = time.monotonic()
                r = server.generate(
                    {
                        "text": text,
                        "sampling_params": {"temperature": 0, "max_new_tokens": 2},
                    }
                )
                meta = r["meta_info"]
                details = meta.get("cached_tokens_details") or {}
                requests.append(
                    dict(
                        phase=phase,
                        prompt=meta["prompt_tokens"],
                        cached=meta["cached_tokens"],
                        host=details.get("host", 0),
                        seconds=time.monotonic() - t0,
                    )
                )
        log = server.log_text()
    finally:
        assert_all_gone(server.stop())
    h2d = load_record.read(record_dir, TP, prefix="h2d-rank")
    host_tokens = [
        int(n)
        for n in re.findall(
            r"Allocating kv hierarchical KV host pool: (\d+) tokens", log
        )
    ]
    revisits = [r for r in requests if r["phase"] == "revisit"]
    loaded_tokens = sum(r["host"] for r in revisits)
    per_rank = []
    for rank, copies in enumerate(h2d):
        nbytes = sum(c["bytes"] for c in copies)
        per_rank.append(
            dict(
                rank=rank,
                copies=len(copies),
                bytes=nbytes,
                bytes_by_pool={
                    pool: sum(c["bytes"] for c in copies if c["pool"] == pool)
                    for pool in sorted({c["pool"] for c in copies})
                },
                layers=sorted({c["layer"] for c in copies}),
                bytes_per_loaded_token=(
                    nbytes / loaded_tokens if loaded_tokens else None
                ),
            )
        )
    return dict(
        model=model,
        server=name,
        host_pool_tokens=host_tokens,
        host_hits=sum(1 for r in revisits if r["host"]),
        loaded_tokens=loaded_tokens,
        ranks=per_rank,
        requests=requests,
    )


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for model in sorted({r["model"] for r in runs}):
        by = {r["server"]: r for r in runs if r["model"] == model}
        base = by.get("replicated")
        for name in ("replicated", "sharded"):
            run = by.get(name)
            if run is None:
                continue
            for rank in run["ranks"]:
                ref = base["ranks"][rank["rank"]] if base else None
                ratio = None
                if (
                    ref
                    and ref["bytes_per_loaded_token"]
                    and rank["bytes_per_loaded_token"]
                ):
                    ratio = (
                        rank["bytes_per_loaded_token"] / ref["bytes_per_loaded_token"]
                    )
                rows.append(
                    dict(
                        model=model,
                        server=name,
                        rank=rank["rank"],
                        host_pool_tokens=(
                            run["host_pool_tokens"][rank["rank"]]
                            if rank["rank"] < len(run["host_pool_tokens"])
                            else None
                        ),
                        host_hits=run["host_hits"],
                        loaded_tokens=run["loaded_tokens"],
                        copies=rank["copies"],
                        layers=rank["layers"],
                        bytes=rank["bytes"],
                        bytes_per_loaded_token=rank["bytes_per_loaded_token"],
                        ratio_vs_replicated=ratio,
                    )
                )
    return rows


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':9} {'server':10} {'rank':>4} {'host tok':>8} {'hits':>4} "
        f"{'loaded tok':>10} {'copies':>6} {'layers':12} {'H2D bytes':>10} "
        f"{'B/token':>8} {'vs repl':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = f"{r['ratio_vs_replicated']:.3f}" if r["ratio_vs_replicated"] else "-"
        per = (
            f"{r['bytes_per_loaded_token']:.0f}" if r["bytes_per_loaded_token"] else "-"
        )
        print(
            f"{r['model']:9} {r['server']:10} {r['rank']:>4} {r['host_pool_tokens'] or '-':>8} "
            f"{r['host_hits']:>4} {r['loaded_tokens']:>10} {r['copies']:>6} "
            f"{str(r['layers']):12} {r['bytes']:>10} {per:>8} {ratio:>7}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['model']}\n{r['server']} r{r['rank']}" for r in rows]
    colors = ["tab:gray" if r["server"] == "replicated" else "tab:blue" for r in rows]
    axes[0].bar(labels, [r["host_pool_tokens"] or 0 for r in rows], color=colors)
    axes[0].set_title("host pool capacity (tokens) at the same --hicache-ratio")
    axes[1].bar(labels, [r["bytes_per_loaded_token"] or 0 for r in rows], color=colors)
    axes[1].set_title("host->device bytes per rank per loaded token")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    runs = []
    for model in args.models:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(run_server, model, name, args) for name in SERVERS]
            runs += [f.result() for f in futures]
    rows = summarize(runs)
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = run_dir(args.out, "live-rank-shard") / "bench_live_rank_shard"
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
        ),
        summary=rows,
        runs=runs,
    )
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
