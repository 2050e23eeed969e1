"""Ports the project's servers and stores are told to listen on.

A port found free by binding to port 0 lies in the kernel's ephemeral range
(``net.ipv4.ip_local_port_range``) and is free only until something binds it.
A server told to listen on it binds it seconds later (sglang after loading its
model), and meanwhile any outgoing connection on the machine may be given it
as its local port: the server then fails with "address already in use". A
port below the ephemeral range is never handed out that way, so
``free_port()`` picks one there at random and checks that it binds now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
# Below Linux's default ephemeral range (32768-60999) and above the ports
# Mooncake's transfer engine picks for itself (seen at 15378 and 16597).
LISTEN_RANGE = (20000, 32000)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_random = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return (32768, 60999)
    return low, high


def listen_range() -> tuple[int, int]:
    """``LISTEN_RANGE`` less any part the kernel's ephemeral range covers."""
    low, high = LISTEN_RANGE
    eph_low, eph_high = ephemeral_range()
    if eph_low < high and eph_high >= low:  # overlap: keep the part below it
        high = eph_low
    if high - low < 1000:
        raise RuntimeError(
            f"no listening range outside the ephemeral ports {eph_low}-{eph_high} "
            f"(net.ipv4.ip_local_port_range) within {LISTEN_RANGE}"
        )
    return low, high


def free_port(host: str = HOST) -> int:
    """A port that binds on ``host`` now, outside the ephemeral range."""
    low, high = listen_range()
    for _ in range(500):
        port = _random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port on {host} in {low}-{high}")
