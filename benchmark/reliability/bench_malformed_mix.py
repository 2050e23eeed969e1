"""Good-request latency with malformed requests mixed in, on a live CPU server.

One ``sglang serve`` of the installed wheel (``harness.live_server.LiveServer``:
the tiny Llama on CPU, 127.0.0.1 only) gets ``--clients`` concurrent clients
(default 16), each sending ``--per-client`` requests back to back, in two
modes that alternate over ``--reps`` repetitions:

* ``good``: only good requests (``/generate``, greedy, ``--new-tokens`` new
  tokens, a seeded 24-word prompt of its own each);
* ``mix``: the same good requests, with ``--bad-share`` (10 %) of the slots
  (seeded positions) taken by malformed requests of
  ``harness.request_fuzz.named_cases``.

The malformed set: the named cases that answer 4xx on pristine 0.5.23 too,
i.e. without those that crash a pristine server (``UPSTREAM_DIES_ON`` and
``SAME_SITE`` of ``tests/registered/server/test_request_fuzz_server.py``: ours
answers 400 for them, through fixes/0001) and its two known 500s; a probe
sends each once to this server before the runs and keeps those answering
4xx (any other is listed in the JSON, not used).

Reported per mode: good-request latency p50/p90/p99 (pooled over the
repetitions, and per repetition), requests per second, and the status counts
of good and bad requests (every good one must be 200, every bad one 4xx);
the ratios are ``mix`` over ``good`` of the same run. The JSON (in ``--out``,
default ``results/``) holds the run metadata, the ``series`` label (the
installed sglang version), the parameters, the summaries and every request;
the PNG beside it plots the latency distributions.

Run: ``.venv/bin/python -m benchmark.reliability.bench_malformed_mix``
(one server start, about 3-5 min on 2 cores).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

import requests

from benchmark.bench_meta import percentile, run_dir, run_metadata
from harness.live_server import LiveServer, assert_all_gone
from harness.request_fuzz import named_cases

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FUZZ_TEST = ROOT / "tests" / "registered" / "server" / "test_request_fuzz_server.py"
VOCAB = 2048  # scripts/tiny_model.py
WORDS = (
    "cache prefix token rank host device page layer tree radix decode prefill "
    "router batch request server model kernel stream copy shard budget queue"
).split()
MODES = ("good", "mix")


def pristine_safe_cases() -> tuple[dict, list[str]]:
    """The named cases pristine 0.5.23 answers without dying or a 500; and
    the names left out."""
    spec = importlib.util.spec_from_file_location("request_fuzz_server", FUZZ_TEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    skip = set(module.UPSTREAM_DIES_ON) | set(module.SAME_SITE) | module.KNOWN_500
    cases = named_cases(VOCAB)
    return {k: v for k, v in cases.items() if k not in skip}, sorted(skip & set(cases))


def post(base_url: str, path: str, body, timeout: float = 300.0) -> tuple[int, float]:
    data = json.dumps(body, allow_nan=True)
    t0 = time.perf_counter()
    try:
        r = requests.post(
            base_url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        )
        status = r.status_code
    except requests.RequestException:
        status = None
    return status, time.perf_counter() - t0


def good_body(rng: random.Random, new_tokens: int) -> dict:
    return {
        "text": " ".join(rng.choice(WORDS) for _ in range(24)),
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens},
    }


def plan(args, rep: int) -> list[list[tuple]]:
    """Per client, its good requests in order: ``("good", body)``."""
    rng = random.Random(args.seed * 1000 + rep)
    return [
        [("good", good_body(rng, args.new_tokens)) for _ in range(args.per_client)]
        for _ in range(args.clients)
    ]


def mixed(args, clients, bad_names, rep):
    """``clients`` with a seeded share of the slots replaced by ``("bad",
    name)``: the same good bodies in the remaining slots."""
    rng = random.Random(args.seed * 1000 + rep + 500)
    total = args.clients * args.per_client
    slots = rng.sample(range(total), round(total * args.bad_share))
    out = [list(c) for c in clients]
    for slot in slots:
        c, i = divmod(slot, args.per_client)
        out[c][i] = ("bad", rng.choice(bad_names))
    return out


def run_mode(base_url, clients, cases) -> dict:
    records = []

    def client(idx, work):
        for kind, item in work:
            if kind == "good":
                status, s = post(base_url, "/generate", item)
                records.append(dict(client=idx, kind="good", status=status, s=s))
            else:
                path, body = cases[item]
                status, s = post(base_url, path, body)
                records.append(
                    dict(client=idx, kind="bad", case=item, status=status, s=s)
                )

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(client, range(len(clients)), clients))
    return dict(wall_s=time.perf_counter() - t0, records=records)


def summarize(records: list[dict], wall_s: float | None = None) -> dict:
    good = [r for r in records if r["kind"] == "good"]
    bad = [r for r in records if r["kind"] == "bad"]
    lat = [r["s"] for r in good if r["status"] == 200]
    out = dict(
        good=len(good),
        good_200=sum(r["status"] == 200 for r in good),
        bad=len(bad),
        bad_4xx=sum(r["status"] is not None and 400 <= r["status"] < 500 for r in bad),
        bad_statuses=dict(
            sorted(
                statistics.Counter(str(r["status"]) for r in bad).items(),
                key=lambda kv: kv[0],
            )
        ),
        p50_ms=percentile(lat, 50) * 1e3,
        p90_ms=percentile(lat, 90) * 1e3,
        p99_ms=percentile(lat, 99) * 1e3,
        mean_ms=statistics.fmean(lat) * 1e3,
    )
    if wall_s:
        out["good_per_s"] = len(lat) / wall_s
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=30)
    ap.add_argument("--bad-share", type=float, default=0.10)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    args = ap.parse_args()
    if args.quick:
        args.per_client, args.reps = 5, 1
    series = importlib.metadata.version("sglang")
    candidates, skipped = pristine_safe_cases()
    t0 = time.perf_counter()
    server = LiveServer("patched", [], name="malformed-mix")
    try:
        probe = {}
        for name, (path, body) in candidates.items():
            probe[name], _ = post(server.base_url, path, body)
        bad_names = sorted(n for n, s in probe.items() if s and 400 <= s < 500)
        cases = {n: candidates[n] for n in bad_names}
        # warm-up: every client once, not measured
        warm = [
            [("good", good_body(random.Random(-1 - i), args.new_tokens))]
            for i in range(args.clients)
        ]
        run_mode(server.base_url, warm, cases)
        reps = []
        for rep in range(args.reps):
            clients = plan(args, rep)
            one = {}
            for mode in MODES:
                work = (
                    clients if mode == "good" else mixed(args, clients, bad_names, rep)
                )
                run = run_mode(server.base_url, work, cases)
                run["summary"] = summarize(run["records"], run["wall_s"])
                one[mode] = run
            reps.append(one)
            print(
                f"rep {rep}: "
                + ", ".join(
                    f"{m} p50 {one[m]['summary']['p50_ms']:.0f} ms "
                    f"p99 {one[m]['summary']['p99_ms']:.0f} ms"
                    for m in MODES
                ),
                flush=True,
            )
        alive = server.get("/health").status_code == 200
    finally:
        assert_all_gone(server.stop())
    pooled = {
        m: summarize(
            [r for x in reps for r in x[m]["records"]],
            sum(x[m]["wall_s"] for x in reps),
        )
        for m in MODES
    }
    ratios = {
        k: pooled["mix"][k] / pooled["good"][k] for k in ("p50_ms", "p90_ms", "p99_ms")
    }
    per_rep_p99 = [
        x["mix"]["summary"]["p99_ms"] / x["good"]["summary"]["p99_ms"] for x in reps
    ]
    _print(args, pooled, ratios, per_rep_p99, bad_names, series)
    meta = {
        **run_metadata(),
        "series": series,
        "params": {
            "clients": args.clients,
            "per_client": args.per_client,
            "bad_share": args.bad_share,
            "new_tokens": args.new_tokens,
            "reps": args.reps,
            "seed": args.seed,
            "model": "tiny-llama",
            "server_args": "[] (scripts/cpu_server.py's CPU flags)",
            "bad_cases": bad_names,
            "left_out_crash_pristine_or_500": skipped,
            "probe_not_4xx": {n: s for n, s in probe.items() if n not in bad_names},
            "latency": "client-measured, request sent to full response",
        },
        "wall_s": time.perf_counter() - t0,
        "server_alive_after": alive,
        "pooled": pooled,
        # the results index shows ratio_vs_* tables
        "ratio_vs_good": {"mix": {k.removesuffix("_ms"): v for k, v in ratios.items()}},
        "p99_ratio_per_rep": per_rep_p99,
        "reps": [
            {m: dict(summary=x[m]["summary"], wall_s=x[m]["wall_s"]) for m in MODES}
            for x in reps
        ],
        "records": [{m: x[m]["records"] for m in MODES} for x in reps],
    }
    path = run_dir(args.out, "malformed-mix" + ("-quick" if args.quick else ""))
    path = path / "bench_malformed_mix.json"
    path.write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    png = path.with_suffix(".png")
    _plot(reps, pooled, ratios, png, series, args)
    shown = [p.relative_to(ROOT) if p.is_relative_to(ROOT) else p for p in (path, png)]
    print(f"\nwrote {shown[0]} and {shown[1]}")
    bad = [
        m
        for m in MODES
        if pooled[m]["good_200"] != pooled[m]["good"]
        or pooled[m]["bad_4xx"] != pooled[m]["bad"]
    ]
    if bad or not alive:
        sys.exit(f"status check failed in {bad or 'liveness'}")


def _print(args, pooled, ratios, per_rep_p99, bad_names, series):
    print(
        f"\n{args.clients} clients x {args.per_client} requests x {args.reps} reps, "
        f"{args.bad_share:.0%} malformed ({len(bad_names)} named cases); {series}"
    )
    head = (
        f"{'mode':<6} {'good':>5} {'200':>5} {'bad':>4} {'4xx':>4} "
        f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'good/s':>7}"
    )
    print(head)
    for m in MODES:
        s = pooled[m]
        print(
            f"{m:<6} {s['good']:>5} {s['good_200']:>5} {s['bad']:>4} "
            f"{s['bad_4xx']:>4} {s['p50_ms']:>8.0f} {s['p90_ms']:>8.0f} "
            f"{s['p99_ms']:>8.0f} {s['good_per_s']:>7.1f}"
        )
    print(
        "mix / good: "
        + ", ".join(f"{k.removesuffix('_ms')} x{v:.3f}" for k, v in ratios.items())
        + "; p99 per rep "
        + ", ".join(f"x{r:.3f}" for r in per_rep_p99)
    )


def _plot(reps, pooled, ratios, png, series, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for m in MODES:
        lat = sorted(
            r["s"] * 1e3
            for x in reps
            for r in x[m]["records"]
            if r["kind"] == "good" and r["status"] == 200
        )
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        ax.plot(lat, ys, label=f"{m} (p99 {pooled[m]['p99_ms']:.0f} ms)")
    ax.set_xlabel("good-request latency (ms)")
    ax.set_ylabel("fraction of good requests")
    ax.set_title("pooled over repetitions")
    ax.legend()
    xs = range(len(reps))
    for off, m in ((-0.2, "good"), (0.2, "mix")):
        bx.bar(
            [x + off for x in xs],
            [x[m]["summary"]["p99_ms"] for x in reps],
            width=0.4,
            label=m,
        )
    bx.set_xticks(list(xs))
    bx.set_xlabel("repetition")
    bx.set_ylabel("good-request p99 (ms)")
    bx.set_title(f"mix / good p99 pooled x{ratios['p99_ms']:.3f}")
    bx.legend()
    fig.suptitle(
        f"{args.clients} clients, {args.bad_share:.0%} malformed requests: {series}"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
