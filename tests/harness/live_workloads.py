"""Multi-turn workloads for live servers (tests and the live routing benchmark).

A conversation is a list of token ids: each turn sends it as ``input_ids``
(prefixes are exact, no re-tokenization), then appends the answer and a new
user message of ``new_tokens`` random ids.  Within a turn the conversations are
sent in a shuffled order by ``clients`` concurrent clients (a fixed
interleaved order would make round_robin accidentally sticky), with
``think_s`` between turns.

With ``stream=True`` every request is a streaming ``/generate`` (SSE lines
``data: {...}`` ending with ``data: [DONE]``) and its record gets ``ttft``, the
client-measured time to the first data chunk.  Streamed ``output_ids`` are
cumulative in 0.5.23 (each chunk carries every id so far; disjoint segments
only with ``--incremental-streaming-output``): ``stream_generate`` tells the
two apart with ``meta_info.completion_tokens`` and returns the full ids.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import requests

from harness.live_server import REQUEST_TIMEOUT_S, greedy

VOCAB = range(10, 2000)


def conversations(n: int, seed: int, first: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(VOCAB) for _ in range(first)] for _ in range(n)]


def shared_system_conversations(
    n: int, seed: int, systems: int, system_tokens: int, question_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """``n`` first prompts: conversation ``c`` starts with system prompt
    ``c % systems`` (``system_tokens`` random ids) and its own question of
    ``question_tokens``.  Also returns each first turn's oracle: the system
    prompt for every conversation but the first of its system prompt."""
    rng = random.Random(seed)
    prompts = [
        [rng.choice(VOCAB) for _ in range(system_tokens)] for _ in range(systems)
    ]
    first = [
        prompts[c % systems] + [rng.choice(VOCAB) for _ in range(question_tokens)]
        for c in range(n)
    ]
    return first, [system_tokens if c >= systems else 0 for c in range(n)]


def _sse_chunks(server, payload: dict, timeout: float):
    """A streaming ``/generate``: yields ``(chunk, seconds since sending)``
    per SSE data chunk, ``(None, seconds)`` for ``[DONE]``."""
    start = time.perf_counter()
    with requests.post(
        f"{server.base_url}/generate",
        json={**payload, "stream": True},
        stream=True,
        timeout=timeout,
    ) as resp:
        if resp.status_code != 200:
            raise AssertionError(
                f"/generate answered {resp.status_code}: {resp.text[:500]}"
            )
        for line in resp.iter_lines(chunk_size=None):
            if not line or not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                yield None, time.perf_counter() - start
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise AssertionError(f"/generate stream error: {chunk}")
            yield chunk, time.perf_counter() - start


def stream_generate(
    server, payload: dict, timeout: float = REQUEST_TIMEOUT_S
) -> tuple[dict, float, str]:
    """One streaming ``/generate``: returns ``(final, ttft, ids_mode)``.

    ``final`` is the last chunk with ``output_ids`` replaced by the request's
    full output ids, ``ttft`` the seconds from sending to the first data chunk
    and ``ids_mode`` how the chunks carried the ids: ``"cumulative"`` or
    ``"incremental"`` (checked against ``meta_info.completion_tokens``).
    """
    ttft = None
    chunks = []
    done = False
    for chunk, seconds in _sse_chunks(server, payload, timeout):
        if chunk is None:
            done = True
            break
        if ttft is None:
            ttft = seconds
        chunks.append(chunk)
    if not chunks or not done:
        raise AssertionError(f"/generate stream ended early ({len(chunks)} chunks)")
    final = dict(chunks[-1])
    n = final["meta_info"]["completion_tokens"]
    joined = [i for c in chunks for i in c["output_ids"]]
    if len(final["output_ids"]) == n and (len(chunks) == 1 or len(joined) != n):
        mode = "cumulative"
    elif len(joined) == n:
        mode, final["output_ids"] = "incremental", joined
    else:
        raise AssertionError(
            f"streamed output_ids fit neither mode: {len(chunks)} chunks, "
            f"last {len(final['output_ids'])} ids, joined {len(joined)}, "
            f"completion_tokens {n}"
        )
    return final, ttft, mode


def _generate(server, input_ids, max_new_tokens, stream, routed_dp_rank=None):
    """One greedy ``/generate`` (streamed with ``stream``; to
    ``routed_dp_rank`` when given): ``(result, latency)``."""
    payload = {"input_ids": input_ids, "sampling_params": greedy(max_new_tokens)}
    if routed_dp_rank is not None:
        payload["routed_dp_rank"] = routed_dp_rank
    start = time.perf_counter()
    if stream:
        r, ttft, mode = stream_generate(server, payload)
        r.update(ttft=ttft, ids_mode=mode)
    else:
        r = server.generate(payload)
    return r, time.perf_counter() - start


def _record(r, prompt: int, latency: float, oracle: int) -> dict:
    meta = r["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    record = dict(
        prompt=prompt,
        cached=meta["cached_tokens"],
        host=details.get("host", 0),
        rank=meta["dp_rank"],
        latency=latency,
        oracle=oracle,
    )
    if "ttft" in r:
        record.update(ttft=r["ttft"], ids_mode=r["ids_mode"])
    return record


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
    stream: bool = False,
    route=None,
    first_prompts: tuple[list[list[int]], list[int]] | None = None,
):
    """``route(c)``: the DP rank to send conversation ``c`` to (the client-side
    sticky policy), None: the server's routing.
    Returns ``records[c][t]`` = dict(prompt, cached, host, rank, latency,
    oracle); with ``stream=True`` also ``ttft`` and ``ids_mode``
    (``stream_generate``).  ``oracle`` is what a rank that kept the whole
    conversation would have cached: the previous turn's prompt and output
    (its last output token never has KV), 0 on the first turn.
    ``first_prompts``: the first turns and their oracles
    (``shared_system_conversations``) instead of ``n`` random prompts of
    ``first`` ids."""
    rng = random.Random(seed + 1)
    if first_prompts is None:
        prompts, oracle = conversations(n, seed, first), [0] * n
    else:
        prompts, oracle = [list(p) for p in first_prompts[0]], list(first_prompts[1])
    records = [[] for _ in range(n)]

    def send(c):
        rank = route(c) if route else None
        return (c, *_generate(server, prompts[c], max_new_tokens, stream, rank))

    with ThreadPoolExecutor(clients) as pool:
        for _ in range(turns):
            order = list(range(n))
            rng.shuffle(order)
            for c, r, latency in pool.map(send, order):
                records[c].append(_record(r, len(prompts[c]), latency, oracle[c]))
                new = [rng.choice(VOCAB) for _ in range(new_tokens)]
                oracle[c] = len(prompts[c]) + len(r["output_ids"]) - 1
                prompts[c] = prompts[c] + r["output_ids"] + new
            time.sleep(think_s)
    return records


class ClientRoundRobin:
    """A ``route`` for ``run_conversations``: client-side round robin, the
    server's ``round_robin`` done by the client. Each request names the next
    DP rank in the order the requests are sent (``routed_dp_rank``, which the
    DP controller honours before its load-balance method), so a server that
    routes by cache can host its own negative control. ``asked[c]`` lists the
    ranks conversation ``c`` was sent to, turn by turn."""

    def __init__(self, ranks: int = 2):
        self.ranks = ranks
        self.asked = defaultdict(list)
        self._next = 0
        self._lock = threading.Lock()

    def __call__(self, c: int) -> int:
        with self._lock:
            rank = self._next % self.ranks
            self._next += 1
            self.asked[c].append(rank)
        return rank

    def kept(self) -> int:
        """Later turns sent to the rank of their conversation's previous turn."""
        return sum(
            prev == cur
            for ranks in self.asked.values()
            for prev, cur in zip(ranks, ranks[1:])
        )


def full_hit_turns(records) -> int:
    """Later turns served their whole previous prompt from cache."""
    return sum(
        cur["cached"] >= prev["prompt"]
        for conv in records
        for prev, cur in zip(conv, conv[1:])
    )


def run_bursts(
    server,
    bursts: int,
    size: int,
    seed: int,
    *,
    prompt_tokens: int = 400,
    question_tokens: int = 30,
    stagger_s: float = 0.03,
    think_s: float = 0.5,
    max_new_tokens: int = 8,
    stream: bool = False,
    route=None,
):
    """Bursts of ``size`` requests that share a new system prompt of
    ``prompt_tokens`` (each with its own question), the i-th sent
    ``i * stagger_s`` after the first (0: all at once, so none can reuse
    another's prefill; ``question_tokens`` 0: identical prompts, an RL
    rollout group).  ``route(b)`` like ``run_conversations``.  Returns
    ``records[b][i]`` like ``run_conversations``; ``oracle`` is the shared
    prompt (all but its last token for identical prompts) for every request
    of a burst but its first."""
    import threading

    rng = random.Random(seed)
    records = []
    shared = prompt_tokens if question_tokens else prompt_tokens - 1
    for b in range(bursts):
        rank = route(b) if route else None
        system = [rng.choice(VOCAB) for _ in range(prompt_tokens)]
        prompts = [
            system + [rng.choice(VOCAB) for _ in range(question_tokens)]
            for _ in range(size)
        ]
        start = threading.Barrier(size)

        def send(i):
            start.wait()
            time.sleep(i * stagger_s)
            return (i, *_generate(server, prompts[i], max_new_tokens, stream, rank))

        burst = []
        with ThreadPoolExecutor(size) as pool:
            for i, r, latency in pool.map(send, range(size)):
                oracle = shared if i else 0
                burst.append(_record(r, len(prompts[i]), latency, oracle))
        records.append(burst)
        time.sleep(think_s)
    return records


def stream_generate_n(server, payload: dict, timeout: float = REQUEST_TIMEOUT_S):
    """One streaming ``/generate`` with ``sampling_params.n`` > 1: returns
    ``[(final_chunk, ttft), ...]`` by ``index`` (each copy's last chunk and
    the seconds from sending to its first chunk)."""
    first, last = {}, {}
    for chunk, seconds in _sse_chunks(server, payload, timeout):
        if chunk is None:
            break
        i = chunk.get("index", 0)
        first.setdefault(i, seconds)
        last[i] = chunk
    n = payload["sampling_params"]["n"]
    if sorted(last) != list(range(n)):
        raise AssertionError(f"stream ended with copies {sorted(last)} of {n}")
    return [(last[i], first[i]) for i in range(n)]


def run_n(
    server,
    groups: int,
    n: int,
    seed: int,
    *,
    prompt_tokens: int = 400,
    think_s: float = 0.5,
    max_new_tokens: int = 8,
    route=None,
):
    """RL rollout groups sent as one streamed request with ``n`` copies of a
    new prompt each (sglang prefills it once, then sends the copies).
    ``route(g)`` like ``run_conversations``. Returns ``records[g][i]`` with
    ``ttft``; ``oracle``: the prompt but its last token, for every copy."""
    rng = random.Random(seed)
    records = []
    for g in range(groups):
        prompt = [rng.choice(VOCAB) for _ in range(prompt_tokens)]
        payload = {
            "input_ids": prompt,
            "sampling_params": greedy(max_new_tokens, n=n),
        }
        if route:
            payload["routed_dp_rank"] = route(g)
        start = time.perf_counter()
        copies = stream_generate_n(server, payload)
        latency = time.perf_counter() - start
        group = []
        for final, ttft in copies:
            record = _record(final, prompt_tokens, latency, prompt_tokens - 1)
            record.update(ttft=ttft, ids_mode="n")
            group.append(record)
        records.append(group)
        time.sleep(think_s)
    return records


def hit_rate(records) -> float:
    flat = [r for conv in records for r in conv]
    return sum(r["cached"] for r in flat) / sum(r["prompt"] for r in flat)
