"""The benchmark part of ``make pr``'s PR.md: tables of figures read from the
committed benchmark JSON (the newest run folder of each kind: their names start
with the UTC start time), each naming its file and the git revision it was
measured at."""

from __future__ import annotations

import json
from pathlib import Path

from common import ROOT

BENCH = ROOT / "benchmark"


def _latest(folder: str, pattern: str) -> Path | None:
    files = sorted((BENCH / folder / "results").glob(pattern))
    return files[-1] if files else None


def _source(path: Path, data: dict) -> str:
    rev = str(data.get("git_revision", "unknown"))[:12]
    label = data.get("series_label")
    return (
        f"`{path.relative_to(ROOT)}` (revision {rev}"
        + (f", series {label}" if label else "")
        + f"; `{data.get('command', '')}`)"
    )


def _table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def _f(value, digits=3) -> str:
    if value is None or value != value:  # missing or NaN
        return "–"
    return f"{value:.{digits}f}"


def routing() -> str:
    parts = []
    live = _latest("cache_aware_routing", "*-live-routing/bench_live_routing.json")
    if live:
        data = json.loads(live.read_text())
        rows = []
        for run in data["runs"]:
            s = run["summary"]
            rows.append(
                [
                    run["mode"],
                    run["policy"],
                    _f(s["hit_rate"]),
                    _f(s["hit_vs_oracle"], 2),
                    "/".join(str(n) for n in s["requests_per_rank"]),
                    f"{s['sticky_conversations']}/{s['conversations']}",
                ]
            )
        parts.append(
            f"Live DP={data['params'].get('dp', 2)} server (CPU, tiny model), "
            + _source(live, data)
            + ":\n\n"
            + _table(
                [
                    "mode",
                    "policy",
                    "hit rate",
                    "/ oracle",
                    "per-rank split",
                    "on one rank",
                ],
                rows,
            )
        )
    sim = _latest("cache_aware_routing", "*-routing-quick/bench_routing.json")
    if sim:
        data = json.loads(sim.read_text())
        rows = []
        for run in data["runs"]:
            for r in run["rows"]:
                if r["policy"] in ("round_robin", "cache_aware", "smg", "dynamo"):
                    rows.append(
                        [
                            run["dp"],
                            run["workload"],
                            r["policy"],
                            _f(r["prefill_tokens_vs_rr"], 2),
                            _f(r["imbalance"], 2),
                            _f(r["ttft_mean_s_vs_rr"], 2),
                            _f(r.get("controller_back_to_back_us_per_req"), 0),
                            _f(r.get("controller_back_to_back_route_us_per_req"), 0),
                        ]
                    )
        parts.append(
            "Trace simulation over real radix trees, "
            + _source(sim, data)
            + ":\n\n"
            + _table(
                [
                    "DP",
                    "workload",
                    "policy",
                    "prefill tokens vs rr",
                    "imbalance",
                    "mean TTFT vs rr",
                    "controller µs/req (back to back)",
                    "the same without taking in digests",
                ],
                rows,
            )
        )
    return "\n".join(parts)


def decode() -> str:
    path = _latest("decode_hicache", "*-decode-admission/bench_decode_admission.json")
    if not path:
        return ""
    data = json.loads(path.read_text())
    keys = ("admitted", "evict_calls", "evicted_tokens", "failed_restores")
    rows = [
        [a["config"]] + [f"{a['upstream'][k]} → {a['patched'][k]}" for k in keys]
        for a in data["admission"]
    ]
    out = (
        "Decode admission on real trees and pools (upstream → patched), "
        + _source(path, data)
        + ":\n\n"
        + _table(["config"] + list(keys), rows)
    )
    rows = [
        [
            x["prefix_tokens"],
            x["policy"],
            f"{x['upstream']['status']} (promised {x['upstream']['promised']})",
            f"{x['patched']['status']} (promised {x['patched']['promised']})",
        ]
        for x in data.get("l3", [])
    ]
    if rows:
        out += "\nL3 prefetch outcome:\n\n" + _table(
            ["prefix tokens", "policy", "upstream", "patched"], rows
        )
    return out


def rank_shard() -> str:
    path = _latest("hicache_rank_shard", "*-rank-shard/bench_rank_shard.json")
    if not path:
        return ""
    data = json.loads(path.read_text())
    rows = [
        [
            f"TP{g['tp']}",
            f"x{_f(g['capacity_ratio'], 2)}",
            f"x{_f(g['h2d_ratio'], 3)}",
            f"x{_f(g['d2h_ratio'], 3)}",
        ]
        for g in data["geometry"]
    ]
    out = (
        "DeepSeek-V3.2-class geometry (61 layers; sharded against replicated), "
        + _source(path, data)
        + ":\n\n"
        + _table(
            ["TP", "host capacity", "H2D bytes per rank", "D2H bytes per rank"], rows
        )
        + "\n"
    )
    rows = [
        [
            r["run"],
            r["gpu"],
            r.get("copies", "2d"),
            _f(r["replicated_load_ms"], 1),
            _f(r["sharded_load_ms"], 1),
            _f(r["load_ratio"], 3),
            "yes" if r.get("sharded_mismatches") == 0 else "no",
        ]
        for r in data.get("gpu", [])
    ]
    if rows:
        out += "Load-back on GPUs (one row per recorded run):\n\n" + _table(
            [
                "run",
                "GPU",
                "stand-in copies",
                "replicated ms",
                "sharded ms",
                "sharded / replicated",
                "bit-exact",
            ],
            rows,
        )
    return out


def fixes() -> str:
    mix = _latest("reliability", "*-malformed-mix/bench_malformed_mix.json")
    if not mix:
        return ""
    data = json.loads(mix.read_text())
    p = data["params"]
    rows = []
    for mode, s in data["pooled"].items():
        rows.append(
            [
                mode,
                f"{s['good_200']}/{s['good']}",
                f"{s['bad_4xx']}/{s['bad']}",
                _f(s["p50_ms"], 0),
                _f(s["p90_ms"], 0),
                _f(s["p99_ms"], 0),
                _f(s["good_per_s"], 2),
            ]
        )
    ratio = data["ratio_vs_good"]["mix"]
    return (
        f"A live CPU server (tiny model), {p['clients']} clients, "
        f"{p['reps']} repetitions of {p['clients'] * p['per_client']} requests "
        f"per mode; in `mix`, {p['bad_share']:.0%} of the slots are malformed "
        f"requests ({len(p['bad_cases'])} named cases) that 0.5.23 also "
        "answers with a 4xx; latency of the good requests, client-measured "
        "(server alive after: "
        f"{'yes' if data.get('server_alive_after') else 'no'}), "
        + _source(mix, data)
        + ":\n\n"
        + _table(
            [
                "mode",
                "good 200",
                "malformed 4xx",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "good/s",
            ],
            rows,
        )
        + f"\nmix / good: p50 x{ratio['p50']:.2f}, p90 x{ratio['p90']:.2f}, "
        f"p99 x{ratio['p99']:.2f} (p99 per repetition: "
        + ", ".join(f"x{r:.2f}" for r in data["p99_ratio_per_rep"])
        + ").\n"
    )


SECTIONS = {
    "fixes": fixes,
    "cache-aware-routing": routing,
    "decode-hicache": decode,
    "hicache-rank-shard": rank_shard,
}


NO_RESULTS = "No committed benchmark results for this feature.\n"


def benchmark_section(feature: str) -> str:
    """The PR's benchmark section: its tables, or ``NO_RESULTS``."""
    make = SECTIONS.get(feature)
    text = make() if make else ""
    return text or NO_RESULTS
