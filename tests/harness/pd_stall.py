"""What a live PD test keeps when one of its requests stalls.

A PD request still unanswered ``bound_s`` after it was posted (``stall_bound``:
from its workload, well under the client's timeout) gets, once, while it is
still stuck:

* a ``py-spy dump --native`` of every process of every server's tree (the
  launcher, DP controller, schedulers, detokenizer: each Python thread with
  its native frames, so the scheduler's mooncake threads show where they
  wait: ``bootstrap_thread``, ``transfer_worker``, ``decode_thread``);
* each server's ``/v1/loads?include=disagg`` (bootstrap, prealloc, transfer
  and inflight queues per rank);
* each server's transfer engine log (mooncake's glog lines, at
  ``MC_LOG_LEVEL=TRACE``: INFO and VLOG(1); on TCP it logs nothing for a
  transfer that succeeds, and every failed connection, progress or status
  timeout at WARNING or ERROR) and its log tail, which with ``PD_DEBUG_ENV``
  holds the DEBUG lines of sglang's mooncake and common disaggregation
  modules (registrations, sender init, aborts, skipped chunks).

``StallWatch.watch(what)`` arms a timer around one request; when no request
outlives its bound the timer is cancelled and nothing else runs. A capture is
printed when it is taken, written beside each server's log
(``stall-N.txt``) and kept in ``captures``; ``report()`` gives them all for
the failure message of whatever failed after it.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

# The servers' side of the capture, set in their environment at start (cheap
# when nothing stalls: a few log lines per request).
PD_DEBUG_ENV = {
    # mooncake's transfer engine (glog): TRACE = INFO and above plus VLOG(1)
    # and its transfer trace (ApplyGlogEnvironment in mooncake's common.cpp).
    "MC_LOG_LEVEL": "TRACE",
    # tests/standins/cpu_server_standins.py: these loggers at DEBUG, the rest
    # of the server at its --log-level.
    # Each logs a few lines per request at most (registrations, sender init,
    # skipped chunks and sends, aborts, failed transfers).
    "SGLANG_TEST_DEBUG_LOGGERS": ",".join(
        [
            "sglang.srt.disaggregation.mooncake.conn",
            "sglang.srt.disaggregation.common.conn",
            "sglang.srt.disaggregation.prefill",
            "sglang.srt.disaggregation.decode",
            "sglang.srt.distributed.device_communicators.mooncake_transfer_engine",
        ]
    ),
}

# One forward of the tiny models (a prefill of a few hundred tokens or a decode
# step): 0.05-0.3 s on two idle cores, ~1.7 s seen with about 13 runnable
# processes per core (4 PD requests of 200 tokens at once: 10-21 s each).
FORWARD_CEILING_S = 2.0
# The bootstrap of a request (the bootstrap server's HTTP routes, mooncake's
# P2P handshake on a decode rank's first transfer): well under a second seen.
BOOTSTRAP_CEILING_S = 15.0


def stall_bound(requests_at_once: int, new_tokens: int) -> float:
    """Seconds a PD request may take before it counts as stalled: its
    bootstrap, then every forward of the requests posted with it (one
    prefill and ``new_tokens`` decode steps each), none batched together."""
    forwards = requests_at_once * (1 + new_tokens)
    return BOOTSTRAP_CEILING_S + FORWARD_CEILING_S * forwards


PYSPY_TIMEOUT_S = 30.0
DUMPS_AT_ONCE = 4
LOADS_TIMEOUT_S = 5.0
LOG_TAIL_CHARS = 20000
ENGINE_LINES = 400
# mooncake logs through glog: "I1206 08:12:54.789570 22571 tcp_transport.cpp:391] ..."
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] .*$", re.M)


def pyspy() -> str | None:
    """The py-spy of this interpreter's venv (``requirements/test-cpu.in``),
    else one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_threads(pid: int) -> str:
    """Every thread of ``pid`` (Python frames with native ones), or why not."""
    exe = pyspy()
    if exe is None:
        return f"pid {pid}: py-spy not found (requirements/test-cpu.in)\n"
    for args in (["--native"], []):  # --native can fail where a plain dump works
        try:
            out = subprocess.run(
                [exe, "dump", *args, "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=PYSPY_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            err = f"py-spy dump {' '.join(args)} timed out after {PYSPY_TIMEOUT_S} s"
            continue
        if out.returncode == 0:
            return out.stdout
        err = (out.stderr or out.stdout).strip()
    return f"pid {pid}: {err}\n"


class StallWatch:
    """``servers``: ``{name: LiveServer}`` of the PD setup (prefill and
    decode workers), read when a capture is taken (a server added later is
    dumped too)."""

    def __init__(self, servers: dict, bound_s: float):
        if bound_s <= 0:
            raise ValueError(f"bound_s must be positive, got {bound_s}")
        self.servers = servers
        self.bound_s = bound_s
        self.captures: list[str] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def watch(self, what: str, bound_s: float | None = None):
        """Arms the capture for one request (``what`` names it) for
        ``bound_s`` (default: the watch's bound)."""
        bound = self.bound_s if bound_s is None else bound_s
        start = time.monotonic()
        timer = threading.Timer(bound, self.capture, args=(what, bound, start))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            if timer.is_alive():  # a capture in progress: let it finish
                timer.join()

    def capture(self, what: str, bound: float, start: float) -> str:
        with self._lock:
            head = (
                f"=== PD request stalled: {what} unanswered after "
                f"{time.monotonic() - start:.1f} s (bound {bound:.1f} s) ===\n"
            )
            parts = [head]
            taken = time.monotonic()
            servers = dict(self.servers)
            for name, server in servers.items():
                parts.append(f"--- {name}: /v1/loads?include=disagg ---\n")
                try:
                    r = server.get("/v1/loads?include=disagg", timeout=LOADS_TIMEOUT_S)
                    parts.append(r.text[:4000] + "\n")
                except requests.RequestException as exc:
                    parts.append(f"unanswered: {exc}\n")
            procs = []  # (server, pid, title)
            for name, server in servers.items():
                roles = {pid: title for title, pid in server.roles().items()}
                procs += [(name, pid, roles.get(pid, "")) for pid in server.pids()]
            # py-spy mostly waits on ptrace: the dumps run side by side
            with ThreadPoolExecutor(DUMPS_AT_ONCE) as pool:
                dumps = list(pool.map(lambda p: dump_threads(p[1]), procs))
            for (name, pid, title), dump in zip(procs, dumps):
                parts.append(f"--- {name}: threads of pid {pid} {title} ---\n")
                parts.append(dump)
            for name, server in servers.items():
                text = server.log_text()
                engine = GLOG_LINE.findall(text)[-ENGINE_LINES:]
                parts.append(f"--- {name}: transfer engine log (mooncake) ---\n")
                parts.append("".join(line + "\n" for line in engine))
                parts.append(f"--- {name}: log tail ({server.logdir}) ---\n")
                parts.append(text[-LOG_TAIL_CHARS:] + "\n")
            parts.append(f"=== captured in {time.monotonic() - taken:.1f} s ===\n")
            text = "".join(parts)
            self.captures.append(text)
            for server in servers.values():
                path = Path(server.logdir) / f"stall-{len(self.captures)}.txt"
                path.write_text(text)
            print(text, flush=True)
            return text

    def report(self) -> str:
        """Every capture taken so far ('' when no request stalled)."""
        return "".join(self.captures)
