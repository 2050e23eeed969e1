"""Live DP routing policies on a real DP=2 (``--dp N``) server (CPU, tiny model).

Unlike ``bench_routing.py`` (a simulation over real radix trees) this starts
the patched wheel's ``sglang serve`` (``harness.live_server.LiveServer``: the
tiny local model on CPU, 127.0.0.1 only) once per policy and mode group and
sends it the multi-turn conversations of ``harness.live_workloads``: each turn
is the previous prompt + its full output ids + ``--new-tokens`` new ids, sent
as ``input_ids`` by streaming ``/generate`` (client-measured TTFT = time to the
first SSE data chunk; ``meta_info`` and the output ids from the final chunk).

Policies (``--load-balance-method``): ``round_robin``, ``total_requests``
(upstream) and ``cache_aware`` (ours, the installed wheel); with
``--baseline-rev REV`` also ``cache_aware@REV``: the same method from the
series as committed at ``REV`` (applied onto the pristine pinned wheel in a
scratch tree that the server gets first on ``PYTHONPATH``), e.g. the routing
as released before a change.  Modes:

* ``shuffled``: one client, each turn's conversations in a shuffled order;
* ``concurrent``: the same with 4 concurrent clients;
* ``burst``: bursts of 6 requests, sent 30 ms apart, that share a new
  400-token system prompt (each with its own question), on a server with
  ``--disable-overlap-schedule`` (with the overlap scheduler the batch after
  the first request's prefill is formed before that prefill's KV is in the
  tree, so no request of a burst can reuse another's on any rank);
* ``small_pool``: 4 concurrent clients on a server with
  ``--max-total-tokens 1536`` and HiCache (direct io, page_first_direct,
  ratio 4), so device prefixes are evicted to the host tier.

Each policy gets three server starts (one per group: ``shuffled`` and
``concurrent``; ``burst``; ``small_pool``; different seeds, no shared
prefixes), one at a time, each stopped with its process tree.
``--server-args`` adds arguments to every start, ``--dp`` sets the DP size.

Reported per policy and mode: hit rate (cached / prompt tokens), the sticky
oracle's hit rate (a rank that kept each conversation or burst prefix whole:
``oracle`` in ``harness.live_workloads``) and hit / oracle, host-tier share of
the cached tokens, requests per DP rank (max, min, max/min), conversations (or
bursts) that stayed on one rank, TTFT p50/p90; ratios are against
``round_robin`` of the same mode in the same run.  The JSON (in ``--out``,
default ``results/``) holds the run metadata, the ``series`` label (the
installed sglang version), the parameters, the summaries and every record;
the PNG beside it plots hit rate, TTFT and stickiness.

Run: ``.venv/bin/python -m benchmark.cache_aware_routing.bench_live_routing
[--quick] [--out DIR]`` (about 6 x 60-120 s of server starts on 2 cores).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

from benchmark.bench_meta import percentile, run_dir, run_metadata
from harness.live_server import HICACHE_ARGS, LiveServer, assert_all_gone
from harness.live_workloads import run_bursts, run_conversations, run_n

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


# sticky: the client sends each conversation (burst, group) to one DP rank
# (``routed_dp_rank``, rank = its index mod DP) on a round_robin server: the
# sticky oracle as a policy, so what it reaches is achievable.
POLICIES = ["round_robin", "total_requests", "cache_aware", "sticky"]
BASELINES = ("round_robin", "total_requests")
MODES = ["shuffled", "concurrent", "burst", "grpo_group", "grpo_n", "small_pool"]
SMALL_POOL = ["--max-total-tokens", "1536", *HICACHE_ARGS, "--hicache-ratio", "4"]
CLIENTS = {"shuffled": 1, "concurrent": 4, "small_pool": 4}
SEED_OFFSET = {
    "shuffled": 0,
    "concurrent": 1000,
    "burst": 3000,
    "small_pool": 2000,
    "grpo_group": 4000,
    "grpo_n": 5000,
}
BURST = dict(size=6, prompt_tokens=400, question_tokens=30, stagger_s=0.03)
# An RL rollout group: 8 identical prompts sent at once, or one request n=8.
GRPO = dict(size=8, prompt_tokens=400, question_tokens=0, stagger_s=0.0)
GRPO_N = dict(n=8, prompt_tokens=400)
OVERLAP = {"on": [], "off": ["--disable-overlap-schedule"]}
DP_ATTENTION = ["--tp", "2", "--enable-dp-attention"]
# Server groups: one start each (per policy and overlap setting), serving
# these modes in this order, each ``--reps`` times (new prompts each time).
GROUPS = [
    ("default", [], ["shuffled", "concurrent", "burst", "grpo_group", "grpo_n"]),
    ("small_pool", SMALL_POOL, ["small_pool"]),
]
ERROR_RE = re.compile(r"Traceback|\bERROR\b|Exception|exception")


def summarize(records, dp=2):
    flat = [r for conv in records for r in conv]
    prompt = sum(r["prompt"] for r in flat)
    cached = sum(r["cached"] for r in flat)
    oracle = sum(r["oracle"] for r in flat)
    host = sum(r["host"] for r in flat)
    per_rank = [sum(r["rank"] == k for r in flat) for k in range(dp)]
    lo, hi = min(per_rank), max(per_rank)
    ttft = [r["ttft"] for r in flat]
    return {
        "requests": len(flat),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "host_tokens": host,
        "hit_rate": cached / prompt if prompt else float("nan"),
        "oracle_hit_rate": oracle / prompt if prompt else float("nan"),
        "hit_vs_oracle": cached / oracle if oracle else float("nan"),
        "host_share": host / cached if cached else 0.0,
        "requests_per_rank": per_rank,
        "rank_max": hi,
        "rank_min": lo,
        "rank_ratio": hi / lo if lo else None,  # None: a rank got nothing
        "sticky_conversations": sum(len({r["rank"] for r in c}) == 1 for c in records),
        "conversations": len(records),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "latency_p50_s": percentile([r["latency"] for r in flat], 50),
        "stream_ids_modes": sorted({r["ids_mode"] for r in flat}),
    }


def log_errors(server, limit=20):
    lines = [ln for ln in server.log_text().splitlines() if ERROR_RE.search(ln)]
    return {"count": len(lines), "first": lines[:limit]}


def subprocess_rev(rev: str) -> str:
    import subprocess

    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def series_tree(rev: str) -> Path:
    """The pristine pinned wheel with the series as committed at ``rev``
    applied (quilt format, -p1), in a scratch directory."""
    import subprocess
    import tarfile
    import tempfile

    from harness.compare import upstream_tree

    root = Path(tempfile.mkdtemp(prefix=f"series-{rev}-"))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "patches"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    tree = root / "tree"
    shutil.copytree(upstream_tree(), tree, symlinks=True)
    series = (root / "patches" / "series").read_text().splitlines()
    for line in series:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        with open(root / "patches" / line, "rb") as f:
            subprocess.run(
                ["patch", "-p1", "-s", "-f", "--no-backup-if-mismatch", "-F0"],
                stdin=f,
                cwd=tree,
                check=True,
            )
    return tree


def run_mode(server, mode, work, seed, route):
    if mode in ("burst", "grpo_group"):
        return run_bursts(
            server,
            bursts=work["n"],
            seed=seed,
            think_s=work["think_s"],
            max_new_tokens=work["max_new_tokens"],
            stream=True,
            route=route,
            **(BURST if mode == "burst" else GRPO),
        )
    if mode == "grpo_n":
        return run_n(
            server,
            groups=work["n"],
            seed=seed,
            think_s=work["think_s"],
            max_new_tokens=work["max_new_tokens"],
            route=route,
            **GRPO_N,
        )
    return run_conversations(
        server, seed=seed, clients=CLIENTS[mode], stream=True, route=route, **work
    )


def serve_group(policy, group, extra, modes, work, seed, tree="patched", **kw):
    """One server start for ``policy``: every mode of the group ``reps``
    times, then stop."""
    dp, reps, overlap, model = kw["dp"], kw["reps"], kw["overlap"], kw["model"]
    name = f"{policy}-{group}-overlap_{overlap}"
    method = policy.split("@", 1)[0]
    route = None
    if method == "sticky":
        method = "round_robin"
        route = lambda i: i % dp  # noqa: E731
    args = ["--dp-size", str(dp), "--load-balance-method", method]
    args += kw["dp_args"] + OVERLAP[overlap] + extra
    t0 = time.perf_counter()
    print(f"[{name}] starting: {' '.join(args)}", flush=True)
    server = LiveServer(tree, args, name=name, model=model)
    info = {
        "policy": policy,
        "group": group,
        "overlap": overlap,
        "server_args": args,
        "start_s": time.perf_counter() - t0,
        "logdir": server.logdir.name,
        # The wheel can be reinstalled under a long run: record what served.
        "sglang": (
            importlib.metadata.version("sglang")
            if tree == "patched"
            else f"series at {policy.split('@', 1)[1]} on the pinned wheel"
        ),
    }
    print(f"[{name}] up in {info['start_s']:.0f} s", flush=True)
    runs = []
    try:
        for mode in modes:
            reps_out = []
            for r in range(reps):
                t1 = time.perf_counter()
                try:
                    records = run_mode(
                        server, mode, work, seed + SEED_OFFSET[mode] + 100 * r, route
                    )
                except Exception as exc:
                    raise RuntimeError(
                        f"{name}/{mode}: {exc}\n{server.log_tail()}"
                    ) from exc
                summary = summarize(records, dp)
                summary["wall_s"] = time.perf_counter() - t1
                reps_out.append({"summary": summary, "records": records})
                print(
                    f"[{name}] {mode} rep {r}: {summary['wall_s']:.0f} s, "
                    f"hit rate {summary['hit_rate']:.3f}, "
                    f"ttft p90 {summary['ttft_p90_s']:.3f}",
                    flush=True,
                )
            runs.append(
                {
                    "policy": policy,
                    "overlap": overlap,
                    "mode": mode,
                    "summary": aggregate(reps_out),
                    "reps": reps_out,
                }
            )
    finally:
        pids = server.stop()
        info["log_errors"] = log_errors(server)
    assert_all_gone(pids)
    return runs, info


SPREAD_KEYS = ("hit_rate", "ttft_p50_s", "ttft_p90_s")


def aggregate(reps):
    """Medians over the repetitions (``KEY``), with ``KEY_min`` and
    ``KEY_max`` for the spread; counts summed; ``ttft_p50_pooled_s`` and
    ``ttft_p90_pooled_s`` over every request of every repetition (a p90 of
    one repetition rests on its two or three slowest requests)."""
    import statistics

    summaries = [x["summary"] for x in reps]
    ttft = [r["ttft"] for x in reps for conv in x["records"] for r in conv]
    out = dict(summaries[0])
    for key in ("hit_rate", "oracle_hit_rate", "hit_vs_oracle", "host_share"):
        out[key] = statistics.median(s[key] for s in summaries)
    for key in ("ttft_p50_s", "ttft_p90_s", "latency_p50_s"):
        out[key] = statistics.median(s[key] for s in summaries)
    for key in SPREAD_KEYS:
        out[key + "_min"] = min(s[key] for s in summaries)
        out[key + "_max"] = max(s[key] for s in summaries)
    for key in ("requests", "conversations", "sticky_conversations"):
        out[key] = sum(s[key] for s in summaries)
    out["requests_per_rank"] = [
        sum(s["requests_per_rank"][k] for s in summaries)
        for k in range(len(out["requests_per_rank"]))
    ]
    lo, hi = min(out["requests_per_rank"]), max(out["requests_per_rank"])
    out["rank_ratio"] = hi / lo if lo else None
    out["reps"] = len(summaries)
    out["ttft_p50_pooled_s"] = percentile(ttft, 50)
    out["ttft_p90_pooled_s"] = percentile(ttft, 90)
    return out


def add_targets(runs):
    """Per mode and overlap setting: ratios against round_robin, hit rate
    against the measured sticky policy, TTFT p90 (pooled over the
    repetitions) against the best of the baselines, and whether a policy
    meets the targets: hit rate >= 0.95 x sticky's where sticky reaches one
    (>= 0.05), pooled TTFT p90 <= 1.05 x the best baseline's."""
    for mode in MODES:
        for overlap in OVERLAP:
            rows = [r for r in runs if r["mode"] == mode and r["overlap"] == overlap]
            by = {r["policy"]: r["summary"] for r in rows}
            rr, sticky = by.get("round_robin"), by.get("sticky")
            base = [by[p]["ttft_p90_pooled_s"] for p in BASELINES if p in by]
            best = min(base) if base else None
            for r in rows:
                s = r["summary"]
                for k in ("hit_rate", "ttft_p50_s", "ttft_p90_s"):
                    s[k + "_vs_rr"] = s[k] / rr[k] if rr and rr[k] else None
                s["hit_vs_sticky"] = (
                    s["hit_rate"] / sticky["hit_rate"]
                    if sticky and sticky["hit_rate"] >= 0.05
                    else None
                )
                s["ttft_p90_vs_best"] = s["ttft_p90_pooled_s"] / best if best else None
                hit_ok = s["hit_vs_sticky"] is None or s["hit_vs_sticky"] >= 0.95
                ttft_ok = s["ttft_p90_vs_best"] is None or s["ttft_p90_vs_best"] <= 1.05
                s["meets_targets"] = hit_ok and ttft_ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--first-tokens", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per mode")
    ap.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES)
    ap.add_argument(
        "--modes", nargs="+", default=MODES, choices=MODES, help="modes to run"
    )
    ap.add_argument(
        "--overlap", nargs="+", default=list(OVERLAP), choices=list(OVERLAP)
    )
    ap.add_argument("--dp", type=int, default=2, help="DP size of every server")
    ap.add_argument(
        "--dp-attention",
        action="store_true",
        help="serve the tiny DeepSeek-V3 (plain MLA) with --tp DP "
        "--enable-dp-attention instead of the tiny llama with plain DP",
    )
    ap.add_argument(
        "--server-args",
        default="",
        help="extra server arguments for every start, e.g. "
        "'--schedule-policy lpm' (in-batch prefix caching for bursts)",
    )
    ap.add_argument(
        "--baseline-rev",
        default=None,
        help="also run cache_aware from the series at this git revision",
    )
    ap.add_argument(
        "--resummarize",
        default=None,
        metavar="JSON",
        help="recompute a run's summaries, table and PNG from its records",
    )
    args = ap.parse_args()
    if args.resummarize:
        return resummarize(Path(args.resummarize))

    work = dict(
        n=args.conversations or (3 if args.quick else 6),
        turns=args.turns or (2 if args.quick else 4),
        first=args.first_tokens,
        new_tokens=args.new_tokens,
        think_s=args.think_s,
        max_new_tokens=args.max_new_tokens,
    )
    reps = 1 if args.quick else args.reps
    dp_args = (
        ["--tp", str(args.dp), "--enable-dp-attention"] if args.dp_attention else []
    )
    model = "tiny-mla" if args.dp_attention else "tiny-llama"
    series = importlib.metadata.version("sglang")
    t0 = time.perf_counter()
    policies = [(p, "patched") for p in args.policies]
    if args.baseline_rev:
        rev = subprocess_rev(args.baseline_rev)
        policies.append((f"cache_aware@{rev}", str(series_tree(rev))))
    runs, servers = [], []
    try:
        for overlap in args.overlap:
            for policy, tree in policies:
                for group, extra, modes in GROUPS:
                    modes = [m for m in modes if m in args.modes]
                    if not modes:
                        continue
                    try:
                        group_runs, info = serve_group(
                            policy,
                            group,
                            extra + shlex.split(args.server_args),
                            modes,
                            work,
                            args.seed,
                            tree,
                            dp=args.dp,
                            reps=reps,
                            overlap=overlap,
                            model=model,
                            dp_args=dp_args,
                        )
                    except Exception as exc:  # keep the other groups' results
                        print(f"[{policy}-{group}] FAILED: {exc}", flush=True)
                        group_runs = []
                        info = {
                            "policy": policy,
                            "group": group,
                            "overlap": overlap,
                            "error": str(exc)[-6000:],
                        }
                    runs += group_runs
                    servers.append(info)
    finally:
        for _, tree in policies:
            if tree != "patched":
                shutil.rmtree(Path(tree).parent, ignore_errors=True)
    add_targets(runs)
    label = f"DP={args.dp}" + (" attention" if args.dp_attention else "")
    _print(runs, servers, series, label)

    os.makedirs(args.out, exist_ok=True)
    meta = {
        **run_metadata(),
        "series": series,
        "params": {
            **work,
            "seed": args.seed,
            "reps": reps,
            "server_args": args.server_args,
            "seed_offsets": SEED_OFFSET,
            "clients": CLIENTS,
            "dp_size": args.dp,
            "dp_attention": args.dp_attention,
            "model": model,
            "overlap": args.overlap,
            "policies": [p for p, _ in policies],
            "modes": args.modes,
            "burst": BURST,
            "grpo_group": GRPO,
            "grpo_n": GRPO_N,
            "small_pool_args": SMALL_POOL,
            "stream": True,
            "ttft": "client-measured, request sent to first SSE data chunk",
            "aggregate": "median over reps, with min and max",
        },
        "wall_s": time.perf_counter() - t0,
        "servers": servers,
        "runs": runs,
    }
    tag = "live-routing" + ("-dp-attention" if args.dp_attention else "")
    path = run_dir(args.out, tag + ("-quick" if args.quick else "")) / (
        "bench_live_routing.json"
    )
    # every request of every repetition: compact
    path.write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    png = path.with_suffix(".png")
    _plot(runs, [p for p, _ in policies], png, series, label)
    shown = [p.relative_to(ROOT) if p.is_relative_to(ROOT) else p for p in (path, png)]
    print(f"\nwrote {shown[0]} and {shown[1]}")
    failed = [f"{s['policy']}-{s['group']}" for s in servers if "error" in s]
    if failed:
        sys.exit(f"failed server groups: {', '.join(failed)}")


def resummarize(path: Path) -> None:
    """The summaries, targets, table and PNG of a stored run, recomputed from
    its records (the same requests, this revision's statistics)."""
    meta = json.loads(path.read_text())
    runs = meta["runs"]
    dp = meta["params"]["dp_size"]
    for run in runs:
        for x in run["reps"]:
            wall = x["summary"]["wall_s"]
            x["summary"] = summarize(x["records"], dp)
            x["summary"]["wall_s"] = wall
        run["summary"] = aggregate(run["reps"])
    add_targets(runs)
    meta["resummarized_by"] = run_metadata().get("git_revision")
    label = f"DP={dp}" + (" attention" if meta["params"].get("dp_attention") else "")
    _print(runs, meta["servers"], meta["series"], label)
    # every request of every repetition: compact
    path.write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    _plot(
        runs,
        meta["params"]["policies"],
        path.with_suffix(".png"),
        meta["series"],
        label,
    )


def fmt_or_dash(x, spec, none="-"):
    """``none`` for a missing value: ``-`` (no round_robin row) or ``inf``."""
    return format(x, spec) if x is not None else format(none, spec.split(".")[0] + "s")


def _print(runs, servers, series, label):
    print(
        f"\nlive {label} routing, sglang {series}; medians over reps [min-max], "
        "pooled: over every request of the reps"
    )
    head = (
        f"{'mode':<11}{'ovl':<4}{'policy':<16}{'reqs':>5}{'hit rate':>9}"
        f"{'[min-max]':>13}{'/sticky':>8}{'oracle':>7}{'host sh':>8}"
        f"{'rank split':>11}{'sticky':>7}{'ttft p50':>9}{'ttft p90':>9}"
        f"{'[min-max]':>13}{'pooled':>7}{'/best':>7}{'target':>7}"
    )
    for mode in MODES:
        rows = [r for r in runs if r["mode"] == mode]
        if not rows:
            continue
        print(f"\n{head}")
        for r in rows:
            s = r["summary"]
            split = "/".join(str(n) for n in s["requests_per_rank"])
            sticky = f"{s['sticky_conversations']}/{s['conversations']}"
            hit_spread = f"{s['hit_rate_min']:.2f}-{s['hit_rate_max']:.2f}"
            p90_spread = f"{s['ttft_p90_s_min']:.2f}-{s['ttft_p90_s_max']:.2f}"
            target = "ok" if s["meets_targets"] else "MISS"
            print(
                f"{mode:<11}{r['overlap']:<4}{r['policy']:<16}{s['requests']:>5}"
                f"{s['hit_rate']:>9.3f}{hit_spread:>13}"
                f"{fmt_or_dash(s['hit_vs_sticky'], '>8.2f')}{s['oracle_hit_rate']:>7.3f}"
                f"{s['host_share']:>8.3f}{split:>11}{sticky:>7}"
                f"{s['ttft_p50_s']:>9.3f}{s['ttft_p90_s']:>9.3f}{p90_spread:>13}"
                f"{s['ttft_p90_pooled_s']:>7.3f}"
                f"{fmt_or_dash(s['ttft_p90_vs_best'], '>7.2f')}{target:>7}"
            )
    print("\nservers (start s, error-like log lines):")
    for s in servers:
        if "error" in s:
            print(
                f"  {s['policy']:<16}{s['group']:<11}{s['overlap']:<4} FAILED (see JSON)"
            )
            continue
        print(
            f"  {s['policy']:<16}{s['group']:<11}{s['overlap']:<4}{s['start_s']:>6.0f} s"
            f"{s['log_errors']['count']:>6}  sglang {s['sglang']}"
        )
    installed = {
        s["sglang"] for s in servers if "@" not in s["policy"] and "sglang" in s
    }
    if len(installed | {series}) > 1:
        print("  WARNING: the installed sglang changed during the run")


def _plot(runs, policies, png, series, label):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(15, 11))
    cols = [
        (m, o)
        for m in MODES
        for o in OVERLAP
        if any(r["mode"] == m and r["overlap"] == o for r in runs)
    ]
    width = 0.8 / len(policies)

    def row(policy, mode, overlap):
        rows = [
            r
            for r in runs
            if r["policy"] == policy and r["mode"] == mode and r["overlap"] == overlap
        ]
        return rows[0]["summary"] if rows else None

    panels = (
        (axes[0], "hit_rate", "prefix hit rate (median, min-max)"),
        (axes[1], "ttft_p90_s", "client TTFT p90 in s (median, min-max)"),
        (axes[2], "ttft_p50_s", "client TTFT p50 in s (median, min-max)"),
    )
    for ax, key, title in panels:
        for j, p in enumerate(policies):
            xs, ys, lo, hi = [], [], [], []
            for i, (m, o) in enumerate(cols):
                s = row(p, m, o)
                if s is None:
                    continue
                xs.append(i + j * width)
                ys.append(s[key])
                lo.append(s[key] - s[key + "_min"])
                hi.append(s[key + "_max"] - s[key])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=p)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cols))])
        ax.set_xticklabels([f"{m}\noverlap {o}" for m, o in cols], fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"live {label} routing, sglang {series}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
