"""A lost Mooncake master is logged once by HiCache's Mooncake backend, and
once when it is back, however many L3 calls fail meanwhile.

On 0.5.23 the backend's batch calls return the store's error codes to HiCache,
which counts them as misses; the server log says nothing of the store (the
client logs a C++ error per call to stderr, if at all). A real
``mooncake_master`` and a segment ``mooncake_client`` on 127.0.0.1 (started
here, every port given), and sglang's own ``MooncakeStore`` backend set up on
them over TCP as a server sets it up (``HiCacheStorageConfig`` with the
master in its extra config). The master is stopped: three ``batch_is_exist``
calls fail with RPC_FAIL (-900) and the backend logs one line naming the
condition and the master; the master is started again on its port: once the
calls succeed and stay quiet, one line says it is back.
"""

import ctypes
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")

HOST = "127.0.0.1"
BIN = Path(sys.executable).parent  # the venv's mooncake_master / mooncake_client
BACKEND_LOGGER = "sglang.srt.mem_cache.storage.mooncake_store"
READY_S = 60.0
QUIET_S = 6.0  # past the backend's quiet period before a recovery is told


def free_port() -> int:
    """A free port below the kernel's ephemeral range: the master is started
    again on its ports, and an outgoing connection could meanwhile be given
    a port of that range."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = list(range(20000, min(low, 32000)))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{min(low, 32000)}")


def _until(call, ok, timeout):
    deadline = time.monotonic() + timeout
    while True:
        result = call()
        if ok(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class TestMooncakeL3ConditionLog(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.logs = Path(tempfile.mkdtemp(prefix="mooncake-l3-log-"))
        cls.addClassCleanup(shutil.rmtree, cls.logs, True)
        cls.procs = {}
        cls.rpc, cls.http = free_port(), free_port()
        cls.addClassCleanup(cls.stop_all)
        cls.start_master()
        cls.procs["client"] = cls.spawn(
            "client",
            [
                str(BIN / "mooncake_client"),
                f"--host={HOST}",
                f"--port={free_port()}",
                f"--master_server_address={HOST}:{cls.rpc}",
                f"--metadata_server={cls.metadata()}",
                "--protocol=tcp",
                "--global_segment_size=16 MB",
            ],
        )
        cls.wait_segment()

        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
            MooncakeStore,
        )

        config = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name=None,
            extra_config={
                "master_server_address": f"{HOST}:{cls.rpc}",
                "metadata_server": cls.metadata(),
                "global_segment_size": 0,
                "protocol": "tcp",
                "local_hostname": HOST,
            },
        )
        cls.backend = MooncakeStore(config)
        # cleanups run last first: the client closes while its master is up
        cls.addClassCleanup(cls.backend.store.close)
        cls.log = _Lines()
        logging.getLogger(BACKEND_LOGGER).addHandler(cls.log)
        cls.addClassCleanup(logging.getLogger(BACKEND_LOGGER).removeHandler, cls.log)

    @classmethod
    def metadata(cls) -> str:
        return f"http://{HOST}:{cls.http}/metadata"

    @classmethod
    def spawn(cls, name, cmd):
        with open(cls.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    @classmethod
    def start_master(cls):
        cls.procs["master"] = cls.spawn(
            "master",
            [
                str(BIN / "mooncake_master"),
                f"--rpc_port={cls.rpc}",
                f"--rpc_address={HOST}",
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_host={HOST}",
                f"--http_metadata_server_port={cls.http}",
                f"--metrics_host={HOST}",
                f"--metrics_port={free_port()}",
            ],
        )

    @classmethod
    def stop(cls, name):
        proc = cls.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    @classmethod
    def stop_all(cls):
        for name in ("client", "master"):
            cls.stop(name)

    @classmethod
    def wait_segment(cls):
        """Until a put of a client of our own lands in the client's segment."""
        from mooncake.store import MooncakeDistributedStore

        probe = MooncakeDistributedStore()
        try:
            deadline = time.monotonic() + READY_S
            while probe.setup(
                HOST, cls.metadata(), 0, 16 << 20, "tcp", "", f"{HOST}:{cls.rpc}"
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no Mooncake master on {cls.rpc}: {cls.logs}")
                time.sleep(0.5)
            buf = bytearray(1024)
            addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
            assert probe.register_buffer(addr, len(buf)) == 0
            code = _until(
                lambda: probe.batch_put_from(["probe"], [addr], [len(buf)])[0],
                lambda c: c == 0,
                READY_S,
            )
        finally:
            probe.close()
        if code != 0:
            raise RuntimeError(f"the segment never mounted ({code}): {cls.logs}")

    def exists(self):
        return self.backend.store.batch_is_exist(["probe"])[0]

    def test_a_lost_master_is_logged_once_and_once_back(self):
        self.assertGreaterEqual(self.exists(), 0)  # the store serves
        mark = len(self.log.lines)
        self.stop("master")
        codes = [self.exists() for _ in range(3)]
        self.assertEqual(codes, [-900] * 3)  # RPC_FAIL: every call fails
        down = [ln for ln in self.log.lines[mark:] if "Mooncake L3" in ln]
        self.assertEqual(len(down), 1, self.log.lines[mark:])
        self.assertIn("master unreachable (RPC_FAIL)", down[0])
        self.assertIn(f"{HOST}:{self.rpc}", down[0])

        mark = len(self.log.lines)
        self.start_master()
        code = _until(self.exists, lambda c: c >= 0, READY_S)
        self.assertGreaterEqual(code, 0, "the master never answered again")
        time.sleep(QUIET_S)
        self.assertGreaterEqual(self.exists(), 0)
        back = [ln for ln in self.log.lines[mark:] if "Mooncake L3" in ln]
        self.assertEqual(len(back), 1, self.log.lines[mark:])
        self.assertIn("back after", back[0])
        self.assertIn("of master unreachable", back[0])


if __name__ == "__main__":
    unittest.main()
