#!/usr/bin/env python3
"""Stress the live PD pair of tests/registered/server/test_pd_decode_hicache_server.py
for the intermittent transfer stall (a request prefill computed whose KV never
completes).

Starts the test's prefill server and its seed decode worker (tiny DeepSeek-V3,
``--tp 2 --dp-size 2 --enable-dp-attention``, KV over ``mooncake_tcp``) with
the capture of ``harness.pd_stall`` on, then posts ``--rounds`` rounds of
``--concurrency`` PD requests of ``--words`` tokens at once, the same body to
both servers (``--jitter``: one side first by up to that many seconds), each
sent to a DP rank by ``--ranks`` (``none``: the seed worker's cache-aware
router), ``--revisits`` of them earlier prompts (decode prefix hits, restored
from the host tier once evicted). A request unanswered after ``--bound``
seconds (default: ``stall_bound`` of one round) is captured (thread dumps of
both trees, the transfer engine's log, written beside each server's log) and
counted as a stall, with the disaggregation queues each server reported;
it is then left to the client timeout. ``--runs`` restarts the pair that many
times. ``--tree upstream`` serves pristine 0.5.23 (with ``--decode generic``
or ``plain``); ``--hold-room-open S`` widens the race of fixes/0015.

    .venv/bin/python scripts/pd_stall_stress.py --tree upstream --decode plain \
        --rounds 4 --concurrency 2 --ranks none --hold-room-open 1 --bound 25 \
        --timeout 60

    .venv/bin/python scripts/pd_stall_stress.py --runs 2 --rounds 25 \
        --ranks none --revisits 0.3 --jitter 0.5

Prints one line per round and a summary; exits 1 when a request stalled.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "registered" / "server"))

import requests  # noqa: E402
import test_pd_decode_hicache_server as pd  # noqa: E402

from harness.live_server import LiveServer, assert_all_gone, free_port  # noqa: E402
from harness.pd_stall import PD_DEBUG_ENV, StallWatch, stall_bound  # noqa: E402

QUEUES = (
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
)


# A decode worker without HiCache (whose host pool start checks free host
# memory): the race of fixes/0015 is prefill's.
PLAIN_DECODE = ["--disaggregation-mode", "decode", *pd.TRANSFER]
PLAIN_DECODE += ["--max-total-tokens", str(pd.DECODE_POOL)]
PLAIN_DECODE += ["--num-reserved-decode-tokens", "16"]
DECODES = {**pd.DECODES, "plain": PLAIN_DECODE}


def queues_at_capture(capture: str) -> str:
    """The disaggregation queues each server reported in a capture."""
    out = []
    for name, loads in re.findall(
        r"^--- (\S+): /v1/loads\?include=disagg ---\n(.*)$", capture, re.M
    ):
        counts = {q: sum(map(int, re.findall(rf'"{q}":(\d+)', loads))) for q in QUEUES}
        out.append(f"{name} " + " ".join(f"{q}={n}" for q, n in counts.items() if n))
    return "; ".join(out)


def one_request(prefill, decode, port, text, rank, watch, timeout, jitter):
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": pd.NEW_TOKENS},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": random.randint(0, 2**62),
    }
    decode_body = body if rank is None else {**body, "routed_dp_rank": rank}
    start = time.monotonic()
    with watch.watch(f"room {body['bootstrap_room']} (rank {rank})"):
        # one side first, by up to ``jitter`` seconds (a router's two posts
        # race; the test posts both at once, or decode first for its burst)
        first_decode = random.random() < 0.5
        gap = random.uniform(0, jitter)
        with ThreadPoolExecutor(2) as pool:
            if first_decode:
                d = pool.submit(decode.post_raw, "/generate", decode_body, timeout)
                time.sleep(gap)
            p = pool.submit(prefill.post_raw, "/generate", body, timeout)
            if not first_decode:
                time.sleep(gap)
                d = pool.submit(decode.post_raw, "/generate", decode_body, timeout)
            try:
                d_resp = d.result()
                ok = d_resp.status_code == 200
                why = "" if ok else d_resp.text[:300]
            except requests.RequestException as exc:
                ok, why = False, f"decode: {exc}"
            try:
                p.result()
            except requests.RequestException as exc:
                why += f" prefill: {exc}"
    return ok, time.monotonic() - start, why


def run_pair(args, run: int) -> tuple[list[float], int, int]:
    port = free_port()
    env = {**pd.PD_ENV, **PD_DEBUG_ENV}
    if args.hold_room_open:  # tests/standins/cpu_server_standins.py
        env["SGLANG_TEST_HOLD_ROOM_OPEN_S"] = str(args.hold_room_open)
    prefill_args = ["--disaggregation-mode", "prefill", *pd.TRANSFER]
    prefill_args += ["--disaggregation-bootstrap-port", str(port)]
    prefill_args += ["--disable-radix-cache"]
    servers: dict = {}
    latencies, failed, stalled = [], 0, 0
    watch = StallWatch(servers, args.bound)
    try:
        t0 = time.monotonic()
        # one after the other: a start is CPU-bound, and a failed start
        # leaves the one already up in ``servers``, stopped below
        servers["prefill"] = LiveServer(
            args.tree, prefill_args, env, "prefill", pd.MODEL
        )
        servers["decode"] = LiveServer(
            args.tree, DECODES[args.decode], env, f"decode-{args.decode}", pd.MODEL
        )
        print(f"run {run}: pair up in {time.monotonic() - t0:.0f} s", flush=True)
        rng = random.Random(args.seed + run)
        seen: list[str] = []
        for rnd in range(args.rounds):
            texts = []
            for _ in range(args.concurrency):
                if seen and rng.random() < args.revisits:
                    # a prompt posted before: a decode prefix hit, restored
                    # from the host tier once the decode pool evicted it
                    texts.append(rng.choice(seen))
                else:
                    texts.append(
                        " ".join(rng.choice(pd.WORDS) for _ in range(args.words))
                    )
            seen += texts
            if args.ranks == "alternate":
                ranks = [(rnd * args.concurrency + i) % 2 for i in range(len(texts))]
            elif args.ranks == "none":
                ranks = [None] * len(texts)
            else:
                ranks = [int(args.ranks)] * len(texts)
            before = len(watch.captures)
            with ThreadPoolExecutor(len(texts)) as pool:
                futs = [
                    pool.submit(
                        one_request,
                        servers["prefill"],
                        servers["decode"],
                        port,
                        t,
                        r,
                        watch,
                        args.timeout,
                        args.jitter,
                    )
                    for t, r in zip(texts, ranks)
                ]
                outs = [f.result() for f in futs]
            stalled += len(watch.captures) - before
            for capture in watch.captures[before:]:
                print(f"  stalled: {capture.splitlines()[0]}", flush=True)
                print(f"  queues then: {queues_at_capture(capture)}", flush=True)
            for ok, lat, why in outs:
                latencies.append(lat)
                if not ok:
                    failed += 1
                    print(f"  failed after {lat:.1f} s: {why}", flush=True)
            print(
                f"run {run} round {rnd}: "
                + " ".join(f"{lat:.2f}" for _, lat, _ in outs),
                flush=True,
            )
            if stalled and args.stop_on_stall:
                break
    finally:
        pids = []
        for s in servers.values():
            pids += s.stop()
        assert_all_gone(pids)
    return latencies, failed, stalled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1, help="pair restarts")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--words", type=int, default=pd.PROMPT_WORDS)
    ap.add_argument("--ranks", default="alternate", help="alternate|none|0|1")
    ap.add_argument("--decode", default="seed", choices=sorted(DECODES))
    ap.add_argument(
        "--tree",
        default="patched",
        help="patched (the venv's wheel) or upstream (pristine 0.5.23; "
        "--decode generic: the seed flags are this project's)",
    )
    ap.add_argument(
        "--hold-room-open",
        type=float,
        default=0.0,
        help="seconds a prefill sender is held after reading its new room "
        "(test-only injection: the lost-bootstrap race, widened)",
    )
    ap.add_argument(
        "--bound",
        type=float,
        default=None,
        help="seconds before a request counts as stalled "
        "(default: harness.pd_stall.stall_bound of one round)",
    )
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--revisits", type=float, default=0.0, help="share of earlier prompts"
    )
    ap.add_argument(
        "--jitter", type=float, default=0.0, help="max seconds between the two posts"
    )
    ap.add_argument("--stop-on-stall", action="store_true")
    args = ap.parse_args()
    if args.bound is None:
        args.bound = stall_bound(args.concurrency, pd.NEW_TOKENS) + args.jitter
    total_stalled = 0
    for run in range(args.runs):
        lat, failed, stalled = run_pair(args, run)
        total_stalled += stalled
        print(
            f"run {run}: {len(lat)} requests, {failed} failed, {stalled} stalled; "
            f"latency median {statistics.median(lat):.2f} s, max {max(lat):.2f} s",
            flush=True,
        )
    print(f"stalls: {total_stalled} in {args.runs} runs")
    return 1 if total_stalled else 0


if __name__ == "__main__":
    sys.exit(main())
