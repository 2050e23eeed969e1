"""A subscriber of sglang's KV event publisher (``--kv-events-config`` with
the ``zmq`` publisher) and what the tests read from its events.

The publisher sends multipart ``[topic, seq (8 bytes, big endian), msgpack
payload]``, the payload an array ``[ts, events, attn_dp_rank]`` of tagged maps
(``type`` = ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``); each DP
rank's publisher binds the endpoint's port + its DP rank. The events are
decoded with msgspec from the raw bytes, no sglang class: what is checked is
what an outside router (SMG's event mode, Dynamo) receives.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import msgspec
import zmq

from harness.live_server import free_port

GPU, CPU = "GPU", "CPU_PINNED"  # StorageMedium values on the wire
STORED, REMOVED = "BlockStored", "BlockRemoved"
TOPIC = "kv"
QUIET_S = 1.5  # no event for this long: the server has published its step


def events_config(port: int) -> str:
    """``--kv-events-config`` for a zmq publisher bound on 127.0.0.1:port."""
    return msgspec.json.encode(
        dict(
            publisher="zmq",
            endpoint=f"tcp://127.0.0.1:{port}",
            bind=True,
            topic=TOPIC,
        )
    ).decode()


class Subscriber:
    """A SUB socket on the publisher's endpoint, received on a thread into
    ``records``: ``(seq, attn_dp_rank, event map)`` per event, in order."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.sock.connect(endpoint)
        self.records: list = []
        self.seqs: list[int] = []
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if not self.sock.poll(100):
                continue
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == TOPIC.encode(), topic
            ts, events, dp_rank = msgspec.msgpack.decode(payload)
            seq = int.from_bytes(seq, "big")
            self.seqs.append(seq)
            self.records += [(seq, dp_rank, e) for e in events]
            self.last = time.monotonic()

    def settle(self, until=lambda: True, timeout: float = 30.0) -> bool:
        """Waits until ``until()`` holds and no event came for ``QUIET_S``;
        whether it did within ``timeout`` (the checks then say what is
        missing)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if until() and time.monotonic() - self.last > QUIET_S:
                return True
            time.sleep(0.1)
        return False

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)
        self.ctx.term()


def blocks(records, page: int):
    """``(history, stores, clears)``: per block hash its ``(type, medium)``
    list in publishing order, ``{(parent, tokens): [(hash, medium)]}`` of
    every store (a coalesced store is a chain: each block's parent is the one
    before it), and the ``seq`` of every ``AllBlocksCleared``."""
    history = defaultdict(list)
    stores = defaultdict(list)
    clears = []
    for seq, _, e in records:
        kind = e["type"]
        if kind == STORED:
            tokens = e["token_ids"]
            assert len(tokens) == page * len(e["block_hashes"]), e
            parent = e.get("parent_block_hash")
            for i, h in enumerate(e["block_hashes"]):
                history[h].append((kind, e.get("medium")))
                key = (parent, tuple(tokens[i * page : (i + 1) * page]))
                stores[key].append((h, e.get("medium")))
                parent = h
        elif kind == REMOVED:
            for h in e["block_hashes"]:
                history[h].append((kind, e.get("medium")))
        else:
            assert kind == "AllBlocksCleared", e
            clears.append(seq)
    return dict(history), dict(stores), clears


def alternation_errors(history) -> list:
    """Blocks whose events of a medium do not alternate Stored, Removed,
    Stored...: a transition reported twice (or a removal never stored)."""
    bad = []
    for h, events in history.items():
        for medium in (GPU, CPU):
            kinds = [k for k, m in events if m == medium]
            want = [STORED if i % 2 == 0 else REMOVED for i in range(len(kinds))]
            if kinds != want:
                bad.append((h, medium, kinds))
    return bad


def publisher_port(ranks: int = 1) -> int:
    """A claimed port below the kernel's ephemeral range (32768 and up,
    ``harness.live_server.free_port``): the SUB socket connects (and ZMQ
    keeps reconnecting) before the server binds, and a reconnect from an
    ephemeral source port equal to the target port would connect the socket
    to itself and take the port (seen: the publisher's bind then fails,
    "Address already in use"); nor can another process's ephemeral port or
    server take it in between. ``ranks``: that many consecutive ports (one
    publisher per DP rank)."""
    return free_port(span=tuple(range(1, ranks)))
