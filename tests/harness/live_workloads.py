"""Multi-turn workloads for live servers (tests and the live routing benchmark).

A conversation is a list of token ids: each turn sends it as ``input_ids``
(prefixes are exact, no re-tokenization), then appends the answer and a new
user message of ``new_tokens`` random ids.  Within a turn the conversations are
sent in a shuffled order by ``clients`` concurrent clients (a fixed
interleaved order would make round_robin accidentally sticky), with
``think_s`` between turns.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

from harness.live_server import greedy

VOCAB = range(10, 2000)


def conversations(n: int, seed: int, first: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(VOCAB) for _ in range(first)] for _ in range(n)]


def run_conversations(
    server,
    n: int,
    turns: int,
    seed: int,
    *,
    first: int = 300,
    new_tokens: int = 60,
    clients: int = 4,
    think_s: float = 0.5,
    max_new_tokens: int = 8,
):
    """Returns ``records[c][t]`` = dict(prompt, cached, host, rank, latency)."""
    rng = random.Random(seed + 1)
    prompts = conversations(n, seed, first)
    records = [[] for _ in range(n)]

    def send(c):
        start = time.perf_counter()
        r = server.generate(
            {"input_ids": prompts[c], "sampling_params": greedy(max_new_tokens)}
        )
        return c, r, time.perf_counter() - start

    with ThreadPoolExecutor(clients) as pool:
        for _ in range(turns):
            order = list(range(n))
            rng.shuffle(order)
            for c, r, latency in pool.map(send, order):
                meta = r["meta_info"]
                details = meta.get("cached_tokens_details") or {}
                records[c].append(
                    dict(
                        prompt=len(prompts[c]),
                        cached=meta["cached_tokens"],
                        host=details.get("host", 0),
                        rank=meta["dp_rank"],
                        latency=latency,
                    )
                )
                new = [rng.choice(VOCAB) for _ in range(new_tokens)]
                prompts[c] = prompts[c] + r["output_ids"] + new
            time.sleep(think_s)
    return records


def hit_rate(records) -> float:
    flat = [r for conv in records for r in conv]
    return sum(r["cached"] for r in flat) / sum(r["prompt"] for r in flat)
