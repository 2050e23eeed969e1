"""scripts/ports.py: the ports our servers and stores are told to listen on
are never picked twice while in use, by our pickers in any process, by
sglang picking its own, or by the kernel for an outgoing connection.

A port is picked free and bound seconds later; the live lane once lost a
whole test class when a server's torch rendezvous port (sglang's own pick in
22000-29999, bound when its scheduler started) was taken meanwhile
("EADDRINUSE" on ``--nccl-port``'s TCPStore)."""

import inspect
import json
import subprocess
import sys
import textwrap

from .conftest import SCRIPTS, import_scripts

(ports,) = import_scripts("ports")

PROCS, PICKS = 4, 100  # 400 picks from about 4700 ports


def _pick_in_processes(prelude: str = "", span=()) -> list[list[int]]:
    """``PICKS`` ports picked in each of ``PROCS`` processes at once, all of
    them alive until every one has picked (a claim lasts its owner's life)."""
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(SCRIPTS)!r})
        import ports
        {prelude}
        span = {tuple(span)!r}
        mine = [ports.free_port(span=span) for _ in range({PICKS})]
        print(json.dumps(mine), flush=True)
        sys.stdin.read()  # held until the parent has every process's picks
        ports.release(*(p + o for p in mine for o in (0, *span)))
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(PROCS)
    ]
    try:
        picks = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    return picks


def _shared(picks: list[list[int]], span=()) -> set[int]:
    """Ports (spans included) handed to more than one process."""
    seen: dict[int, int] = {}
    shared = set()
    for i, mine in enumerate(picks):
        for port in mine:
            for p in (port, *(port + o for o in span)):
                if seen.setdefault(p, i) != i:
                    shared.add(p)
    return shared


def test_processes_picking_at_once_never_share_a_port():
    picks = _pick_in_processes(span=(233, 234))
    assert not _shared(picks, (233, 234)), sorted(_shared(picks, (233, 234)))
    # negative control: free_port without the machine-wide claim (a port that
    # binds now is all it checks) hands the same ports to several processes
    unclaimed = _pick_in_processes("ports.claim = lambda port: True")
    assert _shared(unclaimed), "picks without claims never overlapped"


def _sglang_own_range() -> tuple[int, int]:
    """The range in which the installed sglang picks a port it binds later."""
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    params = inspect.signature(get_free_port_below_ephemeral).parameters
    return params["low"].default, params["high"].default + 1


def _outside(picks, low, high):
    return [p for mine in picks for p in mine if low <= p < high]


def test_no_port_in_sglangs_own_range_or_the_ephemeral_range():
    low, high = _sglang_own_range()
    assert ports.SGLANG_OWN == (low, high)
    eph_low, eph_high = ports.ephemeral_range()
    picks = _pick_in_processes(span=(7,))
    spans = [[p + o for p in mine for o in (0, 7)] for mine in picks]
    assert not _outside(spans, low, high)
    assert not _outside(spans, eph_low, eph_high + 1)
    # negative control: without sglang's range left out, picks land in it
    unguarded = _pick_in_processes("ports.SGLANG_OWN = (0, 0)")
    assert _outside(unguarded, low, high), "no pick fell in sglang's range"


def test_a_claim_holds_while_its_owner_lives_and_is_taken_over_after():
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import ports; "
            "print(ports.free_port(), flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    port = int(owner.stdout.readline())
    try:
        assert not ports.claim(port), f"port {port} claimed twice"
    finally:
        owner.stdin.close()
        owner.wait(timeout=60)
    assert ports.claim(port), f"port {port} still held after its owner exited"
    ports.release(port)
    assert not (ports.REGISTRY / str(port)).exists()
