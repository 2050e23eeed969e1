"""A real ``sglang`` server on CPU for the live tests (one at a time).

``LiveServer("patched" | "upstream", extra_args)`` starts ``sglang serve`` of
the tiny local model on 127.0.0.1 with the command line of upstream's
``popen_launch_server`` (``sglang serve --model-path M ARGS --host H --port
P``, plus upstream's ``--sleep-on-idle``: ``IDLE_ARGS``) and the CPU
environment of ``scripts/cpu_server.py`` (the same one ``make serve-cpu``
uses), and waits for ``/health_generate`` as that helper
does, polling every half second instead of every 10 s (and with no second,
online launch after a failed one: the models are local).  ``upstream`` puts the pristine unpacked 0.5.23 wheel
first on ``PYTHONPATH``, so the same venv serves unpatched upstream.  The
server's stdout/stderr go to files that are printed when a start fails or a
test using it fails; ``stop()`` stops it by PID with its whole process tree.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

TESTS_DIR = Path(__file__).resolve().parent.parent
ROOT = TESTS_DIR.parent
sys.path.insert(0, str(ROOT / "scripts"))
try:
    import cpu_server  # noqa: E402
    import ports  # noqa: E402
    import tiny_model  # noqa: E402
finally:
    sys.path.pop(0)

# Startup on 2 busy cores: ~35-45 s single, 60-120 s at DP=2; allow 3x that.
START_TIMEOUT_S = {1: 240.0, 2: 420.0, 4: 600.0}
REQUEST_TIMEOUT_S = 120.0
HICACHE_ARGS = list(cpu_server.HICACHE_ARGS)
# Upstream's --sleep-on-idle: a scheduler with nothing queued, running or in
# flight (``Scheduler.is_fully_idle``, HiCache and PD queues included) waits
# on its sockets for up to 1 s instead of looping (every loop runs the pool
# and tree checks, and under TP or DP attention a collective). Without it
# every idle server of a test spins a core's worth of processes, which on 2
# cores the working servers of the same test then lack. The DP controller of
# a --dp-size server waits too (fixes/0025), and a cache-aware rank sends its
# last digest change before it sleeps (cache-aware-routing 0005).
IDLE_ARGS = ["--sleep-on-idle"]


def free_port(span: tuple[int, ...] = ()) -> int:
    """A port for a server to listen on (``scripts/ports.py``: outside the
    ephemeral range and sglang's own, claimed for this process, so neither an
    outgoing connection, nor a server picking its own, nor another of our
    pickers takes it meanwhile); ``span``: offsets claimed with it."""
    return ports.free_port(cpu_server.HOST, span)


# The ports a server derives from its HTTP port under DP attention on one
# node (0.5.23's PortArgs: its dist-init port at +ZMQ_TCP_PORT_DELTA (233),
# then six ZMQ ports), and from --dist-init-addr's port on several nodes.
DP_DERIVED = tuple(range(233, 241))
DIST_INIT_DERIVED = tuple(range(1, 8))


def model_path(name: str = "tiny-llama") -> Path:
    return tiny_model.ensure(tiny_model.model_dir(name), name)


class LiveServer:
    def __init__(
        self,
        tree: str,
        extra_args: list[str] | None = None,
        env: dict | None = None,
        name: str = "server",
        model: str = "tiny-llama",
        nodes: int = 1,
    ):
        self.tree = tree
        self.extra_args = list(extra_args or [])
        if nodes > 1:  # one launcher per node on this machine, node 0 serves
            self.extra_args += ["--nnodes", str(nodes)]
            addr = f"{cpu_server.HOST}:{free_port(DIST_INIT_DERIVED)}"
            self.extra_args += ["--dist-init-addr", addr]
        one_group = "--enable-dp-attention" in self.extra_args or (
            cpu_server.dp_size_of(self.extra_args) == 1
        )
        if one_group and "--nccl-port" not in self.extra_args:
            # sglang would pick it itself and bind it only once its scheduler
            # starts: another server starting meanwhile could pick it too.
            # (DP without DP attention starts a TP group per DP rank, each
            # picking its own port: a given one would be every group's.)
            self.extra_args += ["--nccl-port", str(free_port())]
        self.followers: list[subprocess.Popen] = []  # node ranks 1..nodes-1
        # claimed until this process exits: a check that the port is free
        # once the server stopped sees no other server of ours on it
        self.port = free_port(DP_DERIVED)
        self.base_url = f"http://{cpu_server.HOST}:{self.port}"
        self.logdir = Path(tempfile.mkdtemp(prefix=f"live-{name}-"))
        self.stdout_path = self.logdir / "stdout.log"
        self.stderr_path = self.logdir / "stderr.log"
        dp = cpu_server.scheduler_ranks(self.extra_args)
        child_env = cpu_server.server_env(self.extra_args)
        if tree == "upstream":
            from harness.compare import upstream_tree

            tree_path = str(upstream_tree())
        elif tree == "patched":
            tree_path = None
        elif (Path(tree) / "sglang" / "__init__.py").is_file():
            tree_path = tree  # another sglang tree (a benchmark's baseline)
        else:
            raise ValueError(f"unknown tree {tree!r}")
        if tree_path:
            child_env["PYTHONPATH"] = os.pathsep.join(
                p for p in (tree_path, child_env.get("PYTHONPATH")) if p
            )
        child_env.update(env or {})
        command = ["sglang", "serve", "--model-path", str(model_path(model))]
        command += cpu_server.cpu_args(self.extra_args)
        command += [a for a in IDLE_ARGS if a not in command]
        child_env.setdefault("SGLANG_WAIT_PORT_TIMEOUT", "120")
        self._out = open(self.stdout_path, "w")
        self._err = open(self.stderr_path, "w")
        for node in range(1, nodes):  # each binds its own health port
            follower = [*command, "--node-rank", str(node)]
            follower += ["--host", cpu_server.HOST, "--port", str(free_port())]
            self.followers.append(
                subprocess.Popen(
                    follower, stdout=self._out, stderr=self._err, env=child_env
                )
            )
        command += ["--host", cpu_server.HOST, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            command, stdout=self._out, stderr=self._err, env=child_env
        )
        try:
            self._wait_healthy(START_TIMEOUT_S.get(dp, 600.0))
        except Exception as exc:
            self.stop()
            raise RuntimeError(
                f"{tree} server failed to start: {exc}\n{self.log_tail()}"
            ) from exc
        except BaseException:  # Ctrl-C while it starts: leave nothing behind
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with requests.Session() as session:
            while time.monotonic() < deadline:
                for proc in (self.proc, *self.followers):
                    if proc.poll() is not None:
                        raise RuntimeError(f"server exited with code {proc.returncode}")
                try:
                    # the server's verdict takes up to its HEALTH_CHECK_TIMEOUT
                    # (20 s): a poll given up before it goes on in the server
                    # beside the next ones (each a 1-token request: see
                    # flush_cache for the one a ready server may still hold)
                    r = session.get(f"{self.base_url}/health_generate", timeout=30)
                    if r.status_code == 200:
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"server not healthy within {timeout:.0f} s")

    # -- requests ---------------------------------------------------------
    def generate(self, payload: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        resp = requests.post(f"{self.base_url}/generate", json=payload, timeout=timeout)
        if resp.status_code != 200:
            raise AssertionError(
                f"/generate answered {resp.status_code}: {resp.text[:500]}"
            )
        return resp.json()

    def post_raw(self, path: str, data, timeout: float = REQUEST_TIMEOUT_S):
        headers = {"Content-Type": "application/json"}
        if not isinstance(data, (str, bytes)):
            data = json.dumps(data)
        return requests.post(
            f"{self.base_url}{path}", data=data, headers=headers, timeout=timeout
        )

    def get(self, path: str, timeout: float = 30.0):
        return requests.get(f"{self.base_url}{path}", timeout=timeout)

    def flush_cache(self, timeout: float = 60.0) -> None:
        """Empties the radix cache once every DP rank is idle (upstream's
        ``/flush_cache?timeout=``: each scheduler answers when its running
        batch and queues are empty, and its channel is the one requests come
        through). So it is also a barrier: whatever was sent before it, a
        ``/health_generate`` of the start's polling included, has finished
        when it returns. (The answer waits for every DP rank but carries DP
        rank 0's outcome only.)"""
        headers = {}
        if "--admin-api-key" in self.extra_args:  # an admin route then
            key = self.extra_args[self.extra_args.index("--admin-api-key") + 1]
            headers["Authorization"] = f"Bearer {key}"
        resp = requests.post(
            f"{self.base_url}/flush_cache",
            params={"timeout": timeout},
            headers=headers,
            timeout=timeout + 30,
        )
        if resp.status_code != 200:
            raise AssertionError(
                f"/flush_cache answered {resp.status_code}: {resp.text}"
            )

    # -- logs and shutdown ------------------------------------------------
    def log_text(self) -> str:
        parts = []
        for path in (self.stdout_path, self.stderr_path):
            if path.exists():
                parts.append(path.read_text(errors="replace"))
        return "\n".join(parts)

    def log_tail(self, chars: int = 8000) -> str:
        """The log's last ``chars``, after the first Python traceback in it
        when that lies before them: where several processes crash, the
        first crash is the cause and the tail holds its consequences (a
        peer's collective failing, the launcher's shutdown)."""
        text = self.log_text()
        head = ""
        first = text.find("Traceback (most recent call last)")
        if 0 <= first < len(text) - chars:
            block = text[first : first + 3000].split("\n\n", 1)[0]
            head = f"--- first traceback in the log ---\n{block}\n"
        return f"--- server log ({self.logdir}) ---\n{head}" + text[-chars:]

    def _close_logs(self):
        for f in (self._out, self._err):
            if not f.closed:
                f.close()

    def pids(self) -> list[int]:
        """PIDs of the launcher(s) and every process under them."""
        if self.proc is None:
            return []
        return [
            pid
            for proc in (self.proc, *self.followers)
            for pid in cpu_server.process_tree(proc.pid)
        ]

    def roles(self) -> dict[str, int]:
        """``{process title: PID}`` of this server's tree (see ``process_roles``)."""
        return process_roles(self.proc.pid) if self.proc is not None else {}

    def stop(self, grace: float = cpu_server.STOP_GRACE_S) -> list[int]:
        """Stop the server and its process tree; returns the tree's PIDs.
        What was still running ``grace`` seconds after the SIGTERM got
        SIGKILL: ``stop_killed`` lists it (empty after a clean stop)."""
        if self.proc is None:
            return []
        pids = self.pids()
        self.stop_killed = []
        for proc in (self.proc, *self.followers):
            self.stop_killed += cpu_server.stop_tree(proc, grace)
        self.proc, self.followers = None, []
        self._close_logs()
        return pids

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def process_roles(pid: int) -> dict[str, int]:
    """``{title: PID}`` of the sglang processes under ``pid`` (itself included).

    sglang names its workers with ``setproctitle``: ``sglang::scheduler`` plus
    the rank labels of its log prefix (``_DP1``, ``_TP1``, ``_DP1_TP1`` under
    DP attention), ``sglang::data_parallel_controller``,
    ``sglang::detokenizer``. The title replaces the command line, so it is
    the first word of ``/proc/PID/cmdline``; processes without one (the
    launcher, multiprocessing's resource tracker) are left out.
    """
    import psutil

    roles = {}
    for p in cpu_server.process_tree(pid):
        try:
            title = (psutil.Process(p).cmdline() or [""])[0].strip()
        except psutil.Error:
            continue
        if title.startswith("sglang::"):
            roles[title] = p
    return roles


def port_is_free(port: int, host: str = cpu_server.HOST) -> bool:
    """Whether a new server could listen on ``port`` now (bound as uvicorn
    binds it: ``SO_REUSEADDR``, so a closed server's TIME_WAIT connections do
    not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        s.listen(1)
        return True


PORT_RELEASE_S = 15.0  # a dead tree's sockets close in the kernel, not at once


def port_release(port: int, within: float = PORT_RELEASE_S) -> dict:
    """Waits (bounded) until a new server could listen on ``port`` again.
    ``free`` and ``after_s`` say whether and when; while it is not, the TCP
    sockets still on the port are recorded as ``holders`` (state and PID, None
    for a socket no process owns any more) so a failure names what held it."""
    import psutil

    start = time.monotonic()
    holders: list = []
    while True:
        if port_is_free(port):
            return dict(
                free=True, after_s=round(time.monotonic() - start, 2), holders=holders
            )
        holders = sorted(
            {
                (c.status, c.pid)
                for c in psutil.net_connections(kind="tcp")
                if c.laddr and c.laddr.port == port
            },
            key=str,
        )
        if time.monotonic() - start > within:
            return dict(free=False, after_s=None, holders=holders)
        time.sleep(0.2)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits until every PID has exited (zombies count as gone); returns the
    ones still running at the timeout."""
    import psutil

    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    alive = [p for p in pids if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if running(p)]
    return alive


def assert_all_gone(pids: list[int], timeout: float = 30.0) -> None:
    """Every PID of a stopped server's tree has exited (no orphan left)."""
    alive = wait_gone(pids, timeout)
    assert not alive, f"processes left behind: {alive}"


def greedy(max_new_tokens: int = 8, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}
