"""A real Mooncake store on 127.0.0.1 for HiCache L3 (``make serve-cpu L3=mooncake``,
the live tests' fixture).

``MooncakeStore(segment="512 MB")`` starts, from this interpreter's venv
(``mooncake-transfer-engine-non-cuda``):

- ``mooncake_master`` (metadata, allocation, leases) with its HTTP metadata
  server and its metrics, every port given (the defaults bind 0.0.0.0 on fixed
  ports);
- a standalone ``mooncake_client`` that contributes the store's memory
  segment, so what a server put outlives that server (a server started with
  ``global_segment_size`` 0 contributes none).

It is ready when the master reports the client's segment mounted.
``evict=False`` turns the master's eviction off, so a full segment stays full
however slowly it was filled (with eviction on, a background thread frees room
once the segment passes its watermark, and slow puts all succeed).
``server_args()`` are the flags that point an sglang server at it
(``--hicache-storage-backend mooncake`` and its extra config); ``stats()``
reads the master's own counters (keys, allocated bytes, put/get requests);
``stop_client()`` / ``start_client()`` and ``stop_master()`` /
``start_master()`` take one part away and bring it back (fault tests);
``stop()`` ends both process trees and checks their ports are free.

Each process runs in its own session (process group), stopped by SIGTERM to
the group, then SIGKILL after a grace. The transfer engine of the client opens
data ports of its own choosing (TCP); its RPC, the master and the metadata
server bind 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

from ports import free_port

HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0
BIN = Path(sys.executable).parent


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _stop_group(proc: subprocess.Popen | None, grace: float = STOP_GRACE_S) -> None:
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class MooncakeStore:
    """A Mooncake master and one segment client, started and stopped together."""

    def __init__(
        self,
        segment: str = "512 MB",
        lease_ttl_ms: int | None = None,
        log_dir: str | None = None,
        evict: bool = True,
    ):
        self.segment = segment
        self.lease_ttl_ms = lease_ttl_ms
        self.evict = evict
        self.rpc_port, self.metadata_port = free_port(), free_port()
        self.metrics_port, self.client_port = free_port(), free_port()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mooncake-store-"))
        self.master = self.client = None
        try:
            self.start_master()
            self.start_client()
        except BaseException:
            self.stop()
            raise

    # ---------------------------------------------------------------- parts
    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.metadata_port}/metadata"

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        try:
            return subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def start_master(self) -> None:
        cmd = [str(BIN / "mooncake_master"), f"--rpc_port={self.rpc_port}"]
        cmd += [f"--rpc_address={HOST}", "--enable_http_metadata_server=true"]
        cmd += [f"--http_metadata_server_host={HOST}"]
        cmd += [f"--http_metadata_server_port={self.metadata_port}"]
        cmd += [f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}"]
        if self.lease_ttl_ms is not None:
            cmd += [f"--default_kv_lease_ttl={self.lease_ttl_ms}"]
        if not self.evict:
            # never above the watermark, and a failed put frees nothing: the
            # segment fills and stays full until keys are removed
            cmd += ["--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0"]
        self.master = self._spawn("master", cmd)
        self._wait(lambda: self.stats() is not None, "the master's metrics")

    def start_client(self) -> None:
        cmd = [str(BIN / "mooncake_client"), f"--host={HOST}"]
        cmd += [f"--port={self.client_port}"]
        cmd += [f"--master_server_address={self.master_address}"]
        cmd += [f"--metadata_server={self.metadata_server}", "--protocol=tcp"]
        cmd += [f"--global_segment_size={self.segment}"]
        self.client = self._spawn("client", cmd)
        self.wait_mounted()

    def capacity(self) -> float:
        """Bytes of the segments the master has mounted (0 while it does
        not answer)."""
        return (self.stats() or {}).get("master_total_capacity_bytes", 0)

    def wait_mounted(self) -> None:
        """Until the client's segment is mounted (after ``start_client``, or
        after ``start_master``: the client mounts it on the new master)."""
        self._wait(lambda: self.capacity() > 0, "the client's segment mounted")

    def wait_unmounted(self, timeout: float = READY_TIMEOUT_S) -> float:
        """After ``stop_client``: until the master has dropped the client's
        segment (it notices a client gone by its missed heartbeats, about
        10 s; meanwhile a transfer to the segment fails); the seconds it took."""
        start = time.monotonic()
        while self.capacity() > 0:
            if time.monotonic() - start > timeout:
                raise TimeoutError(
                    f"mooncake master still mounts the stopped client's segment "
                    f"after {timeout} s"
                )
            time.sleep(0.2)
        return time.monotonic() - start

    def stop_client(self) -> None:
        _stop_group(self.client)

    def stop_master(self) -> None:
        _stop_group(self.master)

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            for name, proc in (("master", self.master), ("client", self.client)):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(
                        f"mooncake {name} exited ({proc.returncode}) waiting for "
                        f"{what}:\n{self.log_tail(name)}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake store: no {what} in {READY_TIMEOUT_S} s")
            time.sleep(0.2)

    # ----------------------------------------------------------- for servers
    def extra_config(self, **overrides) -> dict:
        """``--hicache-storage-backend-extra-config`` of a server on this
        store: it contributes no segment (the client holds the data)."""
        config = {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "global_segment_size": 0,
            "local_hostname": HOST,
        }
        config.update(overrides)
        return config

    def server_args(self, **overrides) -> list[str]:
        return [
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-storage-backend-extra-config",
            json.dumps(self.extra_config(**overrides)),
        ]

    def stats(self) -> dict | None:
        """The master's own gauges and counters (None while it does not answer)."""
        url = f"http://{HOST}:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def _http(self, path: str) -> bytes:
        url = f"http://{HOST}:{self.metrics_port}{path}"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read()

    def keys(self) -> list[str]:
        """Every key the master holds (its ``/get_all_keys``)."""
        return [k for k in self._http("/get_all_keys").decode().splitlines() if k]

    def sizes(self, keys: list[str]) -> dict[str, int]:
        """Key -> the object's size in bytes, as the master allocated it
        (its ``/query_key``, which leases each object for 10 s; a key it does
        not hold is left out)."""
        out = {}
        for key in keys:
            try:
                body = json.loads(self._http(f"/query_key?key={quote(key)}"))
            except OSError:
                continue
            if body.get("success") and body.get("data"):
                out[key] = int(body["data"][0]["size_"])
        return out

    def remove(self, keys: list[str]) -> list[int]:
        """Removes objects as a client of the store does (a short-lived Python
        client in its own process, contributing no memory), forced: an object
        a lease still covers (an existence or replica query, ``sizes()``
        included, leases it for the master's ``default_kv_lease_ttl``, 10 s)
        goes too, as an object lost to the store would; one result per key, 0 on success.
        """
        code = (
            "import json, sys\n"
            "from mooncake.store import MooncakeDistributedStore\n"
            "m = MooncakeDistributedStore()\n"
            "rc = m.setup(sys.argv[1], sys.argv[2], 0, 16 << 20, 'tcp', '', sys.argv[3])\n"
            "assert rc == 0, f'mooncake client setup: {rc}'\n"
            "print(json.dumps([m.remove(k, True) for k in json.loads(sys.argv[4])]))\n"
        )
        args = [HOST, self.metadata_server, self.master_address, json.dumps(keys)]
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=READY_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"mooncake remove failed:\n{proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    # ------------------------------------------------------------------ end
    def ports(self) -> list[int]:
        return [self.rpc_port, self.metadata_port, self.metrics_port, self.client_port]

    def stop(self) -> dict:
        """Both process trees ended; which of their ports are still held."""
        self.stop_client()
        self.stop_master()
        held = []
        deadline = time.monotonic() + STOP_GRACE_S
        for port in self.ports():
            while not port_free(port) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not port_free(port):
                held.append(port)
        return dict(held_ports=held)

    def __enter__(self) -> "MooncakeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
