"""Ports the project's servers and stores are told to listen on.

A port found free now is free only until something binds it, and a server
told to listen on one binds it seconds later (sglang after loading its model).
Three kinds of picker can take it meanwhile, and each is kept apart here:

* the kernel, for any outgoing connection's local port: it hands out only
  the ephemeral range (``net.ipv4.ip_local_port_range``), which no port here
  comes from;
* sglang itself: a server not given ``--nccl-port`` picks its torch
  rendezvous port in 22000-29999 and binds it later
  (``get_free_port_below_ephemeral``), a gap no port here comes from;
* this project's own pickers, in every process at once (the two pytest lanes,
  the forked checks, a ``make serve-cpu``): each port handed out is claimed
  machine-wide first, by a file named after it in a registry folder holding
  the claimant's PID, written under the registry's lock. A claim lasts until
  the claimant releases it or exits.

``free_port()`` returns a claimed port that binds now; ``span`` claims the
ports at those offsets from it too (a DP-attention server derives its ZMQ
ports from its HTTP port, a publisher per DP rank takes consecutive ports).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

HOST = "127.0.0.1"
# Below Linux's default ephemeral range (32768-60999) and above the ports
# Mooncake's transfer engine picks for itself (seen at 15378 and 16597).
LISTEN_RANGE = (20000, 32000)
# Where sglang picks a port it binds later when none is given
# (sglang/srt/utils/network.py, get_free_port_below_ephemeral).
SGLANG_OWN = (22000, 30000)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
REGISTRY = Path(tempfile.gettempdir()) / f"sglang-test-ports-{os.getuid()}"
_random = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return (32768, 60999)
    return low, high


def listen_ranges() -> list[tuple[int, int]]:
    """``LISTEN_RANGE`` less sglang's own range and any part the kernel's
    ephemeral range covers (half-open ranges)."""
    low, high = LISTEN_RANGE
    eph_low, eph_high = ephemeral_range()
    out = []
    for a, b in ((low, SGLANG_OWN[0]), (SGLANG_OWN[1], high)):
        if eph_low < b and eph_high >= a:  # overlap: keep the part below it
            b = min(b, eph_low)
        if b > a:
            out.append((a, b))
    if sum(b - a for a, b in out) < 1000:
        raise RuntimeError(
            f"no listening range outside the ephemeral ports {eph_low}-{eph_high} "
            f"(net.ipv4.ip_local_port_range) and sglang's {SGLANG_OWN} within "
            f"{LISTEN_RANGE}"
        )
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _registry_locked():
    """The registry, locked against every other process's claims and
    releases (an exclusive ``flock`` of its lock file, which the kernel drops
    with its holder)."""
    REGISTRY.mkdir(mode=0o700, exist_ok=True)
    with open(REGISTRY / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _owner(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def claim(port: int) -> bool:
    """Claim ``port`` for this process, machine-wide; False when a live
    process (this one included) holds it. A claim whose owner exited is
    taken over."""
    path = REGISTRY / str(port)
    with _registry_locked():
        owner = _owner(path)
        if owner is not None and _alive(owner):
            return False
        path.write_text(str(os.getpid()))
        return True


def release(*ports: int) -> None:
    """Give back this process's claims on ``ports``."""
    with _registry_locked():
        for port in ports:
            path = REGISTRY / str(port)
            if _owner(path) == os.getpid():
                path.unlink()


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = HOST, span: tuple[int, ...] = ()) -> int:
    """A port that binds on ``host`` now, claimed for this process, outside
    the ephemeral range and sglang's own; ``span``: offsets from it that are
    claimed and checked too (each within the same range)."""
    offsets = (0, *span)
    if min(offsets) < 0:
        raise ValueError(f"span offsets must not be negative: {span}")
    ranges = listen_ranges()
    # the first port of each range from which the whole span stays in it
    starts = [(a, b - max(offsets)) for a, b in ranges if b - max(offsets) > a]
    for _ in range(500):
        a, b = _random.choice(starts)
        port = _random.randrange(a, b)
        claimed = []
        for p in (port + o for o in offsets):
            if not claim(p):
                break
            claimed.append(p)
            if not _binds(host, p):
                break
        else:
            return port
        release(*claimed)
    raise RuntimeError(f"no free port on {host} in {ranges}")
