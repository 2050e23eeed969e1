"""Faults on a live server: a worker killed or the server stopped while
streamed requests are in flight, and what every client then saw.

``Streams(base_url, n)`` opens ``n`` streamed ``/generate`` requests (greedy,
``ignore_eos``, long enough to still run when the fault comes) from threads;
``wait_started`` returns once each (``every=False``: one) of them has streamed
its first event and none has ended (with one, all are sent by then; some may
wait in the server's queue: in flight all the same). Each stream's outcome is
``done`` (200, every token, ``[DONE]``), ``error`` (an error event, an error
status, or the connection cut: the client knows it failed) or ``running``
(no end yet: a hang, if it stays so). ``kill_role(pid_of_role, ...)`` SIGKILLs
one process of a server's tree and measures, from the kill: when every
stream had ended, when the whole tree was gone, whether the port is free.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import requests

from harness.live_server import wait_gone

FIRST_EVENT_TIMEOUT_S = 120.0


class Streams:
    def __init__(self, base_url: str, n: int, max_new_tokens: int, prefix="fault"):
        self.max_new_tokens = max_new_tokens
        self.outcomes: list[dict] = [{"state": "running"} for _ in range(n)]
        self._any = threading.Event()
        self._first = [threading.Event() for _ in range(n)]
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(base_url, i, f"{prefix} stream {i}"),
                daemon=True,
            )
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def _run(self, base_url, i, text):
        out = self.outcomes[i]
        body = {
            "text": text,
            "stream": True,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": self.max_new_tokens,
                "ignore_eos": True,
            },
        }
        tokens, done, error = 0, False, None
        try:
            with requests.post(
                f"{base_url}/generate", json=body, stream=True, timeout=(10, 600)
            ) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}"
                for line in r.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    self._any.set()
                    self._first[i].set()
                    if line == b"data: [DONE]":
                        done = True
                        continue
                    event = json.loads(line[len(b"data: ") :])
                    if "error" in event:
                        error = f"error event: {str(event['error'])[:200]}"
                    else:
                        tokens = event["meta_info"]["completion_tokens"]
                        out.setdefault("dp_rank", event["meta_info"].get("dp_rank"))
        except requests.RequestException as exc:
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        out["tokens"] = tokens
        out["ended"] = time.monotonic()
        if done and error is None and tokens == self.max_new_tokens:
            out["state"] = "done"
        else:
            out["state"] = "error"
            out["error"] = error or f"ended after {tokens} tokens without [DONE]"
        self._any.set()

    def wait_started(
        self, every: bool = True, timeout: float = FIRST_EVENT_TIMEOUT_S
    ) -> None:
        if every:
            deadline = time.monotonic() + timeout
            for i, ev in enumerate(self._first):
                if not ev.wait(max(0.0, deadline - time.monotonic())):
                    raise AssertionError(f"stream {i} got no event in {timeout:.0f} s")
        elif not self._any.wait(timeout):
            raise AssertionError(f"no stream got an event in {timeout:.0f} s")
        ended = [o for o in self.outcomes if o["state"] != "running"]
        if ended:
            raise AssertionError(f"streams ended before the fault: {ended}")

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def summary(self, since: float) -> list[dict]:
        """Each outcome, its end in seconds after ``since``."""
        return [
            dict(
                {k: v for k, v in o.items() if k != "ended"},
                **({"after_s": round(o["ended"] - since, 2)} if "ended" in o else {}),
            )
            for o in self.outcomes
        ]


def kill_during_streams(
    base_url: str,
    tree: list[int],
    victim: int,
    max_new_tokens: int,
    n: int = 8,
    bound: float = 60.0,
) -> dict:
    """SIGKILL ``victim`` (a PID of ``tree``) while ``n`` streams run.

    ``max_new_tokens``: enough that the streams still run at the kill, few
    enough that all ``n`` fit the KV pool at once (a queued one gets no event
    before the kill).

    Returns ``streams`` (each outcome, ended ``after_s`` the kill), ``clients_s``
    (kill to the last stream's end; None if one is still running at
    ``bound``), ``tree_s`` (kill to the whole tree gone; None past ``bound``)
    and ``left`` (PIDs still running then)."""
    streams = Streams(base_url, n, max_new_tokens)
    streams.wait_started()
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    streams.join(bound)
    ends = [o.get("ended") for o in streams.outcomes]
    clients_s = None if None in ends else max(ends) - killed_at
    left = wait_gone(tree, max(1.0, killed_at + bound - time.monotonic()))
    tree_s = None if left else time.monotonic() - killed_at
    return dict(
        streams=streams.summary(killed_at),
        clients_s=clients_s and round(clients_s, 2),
        tree_s=tree_s and round(tree_s, 2),
        left=left,
    )
