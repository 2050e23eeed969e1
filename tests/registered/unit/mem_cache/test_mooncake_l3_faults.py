"""A real Mooncake store taken apart under the client HiCache uses, through
fixes/0024's ``observe_store_health``: one log line per change of condition.

A master and a 16 MB segment client on 127.0.0.1 (``harness.mooncake_l3``), and
the ``MooncakeDistributedStore`` client of ``mooncake-transfer-engine-non-cuda``
set up as sglang's Mooncake backend sets it up (no segment of its own, TCP),
wrapped as the backend wraps it. Each fault is made by the store itself:

* full: 1 MB objects put into a 16 MB segment on a master that does not
  evict, so the 16 first fit and the rest find no room (NO_AVAILABLE_HANDLE)
  however slowly they come (a master that evicts frees room behind slow
  puts); then one removed: a put fits and the next finds no room again
  (puts failing and succeeding by turns, as behind a store evicting at
  capacity: one condition); then some removed, and puts succeed again;
* the segment client stopped: a get of a stored object fails (TRANSFER_FAIL)
  until the master drops the segment, then a put finds no space; the client
  started again, a put succeeds;
* the master stopped: an exists query fails (RPC_FAIL); the master started
  again, a put succeeds (the client mounts its segment on the new master).

Each fault must log exactly one line naming it, however many calls fail, and
each recovery one line naming what it recovered from, at the first success a
quiet period after the last failure. (The live PD test
makes the master and client faults under a serving decode worker.)
"""

import ctypes
import logging
import time
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness import mooncake_l3

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "series"  # the series group it tests (or "series")

SEGMENT_MB = 16
OBJECT = 1024 * 1024
OVERFILL = 8  # puts past the segment's room
HEALTH_LOGGER = "sglang.srt.mem_cache.storage.mooncake_store.health"
RECOVER_S = 30.0  # a restarted master mounts the client's segment again


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _until(call, ok, timeout):
    deadline = time.monotonic() + timeout
    while True:
        result = call()
        if ok(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


class TestMooncakeL3Faults(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from mooncake.store import MooncakeDistributedStore
        from sglang.srt.mem_cache.storage.mooncake_store.health import (
            observe_store_health,
        )

        cls.store = mooncake_l3.MooncakeStore(segment=f"{SEGMENT_MB} MB", evict=False)
        cls.addClassCleanup(cls.store.stop)
        client = MooncakeDistributedStore()
        rc = client.setup(
            "127.0.0.1",
            cls.store.metadata_server,
            0,
            64 * 1024 * 1024,
            "tcp",
            "",
            cls.store.master_address,
        )
        assert rc == 0, f"MooncakeDistributedStore.setup: {rc}"
        cls.buf = bytearray(OBJECT)
        cls.addr = ctypes.addressof((ctypes.c_char * OBJECT).from_buffer(cls.buf))
        assert client.register_buffer(cls.addr, OBJECT) == 0
        cls.client = observe_store_health(client, cls.store.master_address, 0)
        cls.log = _Lines()
        logging.getLogger(HEALTH_LOGGER).addHandler(cls.log)
        cls.addClassCleanup(logging.getLogger(HEALTH_LOGGER).removeHandler, cls.log)
        cls.results = cls.run_faults()

    @classmethod
    def put(cls, key):
        return cls.client.batch_put_from([key], [cls.addr], [OBJECT])[0]

    @classmethod
    def recover(cls, key, timeout) -> int:
        """Puts until one succeeds (at most ``timeout``), then once more after
        the health's quiet period: the code of that last put."""
        from sglang.srt.mem_cache.storage.mooncake_store.health import RECOVERED_QUIET_S

        _until(lambda: cls.put(f"{key}-{time.monotonic()}"), lambda c: c == 0, timeout)
        time.sleep(RECOVERED_QUIET_S + 0.5)
        return cls.put(f"{key}-after-quiet")

    @classmethod
    def run_faults(cls) -> dict:
        out = {}
        lines = cls.log.lines

        # full: more objects than the segment holds
        mark = len(lines)
        codes = [cls.put(f"fill-{i}") for i in range(SEGMENT_MB + OVERFILL)]
        out["fill_codes"] = codes
        # by turns: room for one, then none again; the quiet period made long
        # enough that the success cannot fall after it on a slow machine
        health = cls.client.health
        quiet, health.quiet_s = health.quiet_s, 3600.0
        stored = [f"fill-{i}" for i, c in enumerate(codes) if c == 0]
        cls.client.batch_remove(stored[:1], True)
        out["turn_codes"] = [cls.put("turn-0"), cls.put("turn-1")]
        health.quiet_s = quiet
        out["full_lines"] = lines[mark:]
        mark = len(lines)
        cls.client.batch_remove(stored[1:4], True)
        out["after_remove"] = cls.recover("after-remove", 5)
        out["full_back_lines"] = lines[mark:]

        # the segment client away: gets of what it held fail
        mark = len(lines)
        cls.store.stop_client()
        out["client_gone_gets"] = [
            cls.client.batch_get_into([stored[-1]], [cls.addr], [OBJECT])[0]
            for _ in range(3)
        ]
        # once the master dropped the segment (missed heartbeats), nothing is
        # left to put into: no space, less severe, no line of its own
        cls.store.wait_unmounted()
        out["client_unmounted_put"] = cls.put("no-segment")
        out["client_lines"] = lines[mark:]
        mark = len(lines)
        cls.store.start_client()
        out["client_back_put"] = cls.recover("client-back", RECOVER_S)
        out["client_back_lines"] = lines[mark:]

        # the master away: every call fails
        mark = len(lines)
        cls.store.stop_master()
        out["master_gone_exists"] = [
            cls.client.batch_is_exist(["after-remove"])[0] for _ in range(3)
        ]
        out["master_lines"] = lines[mark:]
        mark = len(lines)
        cls.store.start_master()
        cls.store.wait_mounted()
        out["master_back_put"] = cls.recover("master-back", RECOVER_S)
        out["master_back_lines"] = lines[mark:]
        return out

    def one_line(self, lines, text):
        self.assertEqual(len(lines), 1, lines)
        self.assertIn(text, lines[0])

    def test_a_full_store_logs_once_then_recovers(self):
        r = self.results
        codes = r["fill_codes"]
        # a segment of SEGMENT_MB MB holds SEGMENT_MB objects of 1 MB; the
        # rest find no room: NO_AVAILABLE_HANDLE
        self.assertEqual(codes, [0] * SEGMENT_MB + [-200] * OVERFILL)
        # the room one removal made fits one put, the next finds none
        self.assertEqual(r["turn_codes"], [0, -200])
        self.one_line(r["full_lines"], "Mooncake L3 no space (NO_AVAILABLE_HANDLE")
        self.assertIn("batch_put_from answered -200", r["full_lines"][0])
        self.assertEqual(r["after_remove"], 0)
        self.one_line(r["full_back_lines"], "Mooncake L3 back after ")
        self.assertIn("of no space", r["full_back_lines"][0])

    def test_a_lost_segment_client_logs_once_then_recovers(self):
        r = self.results
        self.assertEqual(r["client_gone_gets"], [-800] * 3)
        self.assertEqual(r["client_unmounted_put"], -200)
        self.one_line(r["client_lines"], "Mooncake L3 segment unavailable")
        self.assertEqual(r["client_back_put"], 0)
        self.one_line(r["client_back_lines"], "of segment unavailable")

    def test_a_lost_master_logs_once_then_recovers(self):
        r = self.results
        self.assertEqual(r["master_gone_exists"], [-900] * 3)
        self.one_line(r["master_lines"], "Mooncake L3 master unreachable (RPC_FAIL)")
        self.assertIn(self.store.master_address, r["master_lines"][0])
        self.assertEqual(r["master_back_put"], 0)
        self.one_line(r["master_back_lines"], "of master unreachable")


if __name__ == "__main__":
    unittest.main()
