"""A DP rank stopped inside its load-snapshot write must not wedge the others.

Every DP scheduler writes its load into one shared-memory file and the DP
controller reads them all. In 0.5.23 each write holds an exclusive lock on the
whole file and each read a shared one: a rank stopped (SIGSTOP, a frozen
container, a debugger) while it writes blocks every other rank's next write
and the controller's next read, forever. Here a real ``ShmLoadSnapshotWriter``
of rank 1, in a process of its own, stops inside its write; rank 0's writer
and the controller's ``ShmLoadSnapshotReader`` must go on (rank 1's slot is
skipped while it is held), and rank 1's load is read again once it is gone.
"""

import multiprocessing
import os
import tempfile
import threading
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")

DEADLINE_S = 10.0  # a write or read takes microseconds; blocked means forever


def _stopped_writer(path, ready, release):
    from sglang.srt.managers.load_snapshot import LoadSnapshot, ShmLoadSnapshotWriter

    writer = ShmLoadSnapshotWriter(path, 2, 1)
    writer.write(LoadSnapshot(dp_rank=1, timestamp=1.0, num_running_reqs=7))
    real = writer._write_payload

    def stop_inside(snapshot):  # the rank stops halfway through its write
        ready.set()
        release.wait(120)
        real(snapshot)

    writer._write_payload = stop_inside
    writer.write(LoadSnapshot(dp_rank=1, timestamp=2.0, num_running_reqs=8))


def _bounded(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    return out, thread.is_alive()


class TestLoadSnapshotStalledWriter(unittest.TestCase):
    def test_a_stopped_writer_blocks_nobody(self):
        from sglang.srt.managers.load_snapshot import (
            LoadSnapshot,
            ShmLoadSnapshotReader,
            ShmLoadSnapshotWriter,
        )

        path = os.path.join(tempfile.mkdtemp(), "loads.shm")
        writer0 = ShmLoadSnapshotWriter(path, 2, 0)
        reader = ShmLoadSnapshotReader(path, 2)
        ctx = multiprocessing.get_context("fork")
        ready, release = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_stopped_writer, args=(path, ready, release))
        child.start()
        try:
            self.assertTrue(ready.wait(60), "rank 1 never reached its write")
            _, blocked = _bounded(
                lambda: writer0.write(
                    LoadSnapshot(dp_rank=0, timestamp=3.0, num_running_reqs=2)
                )
            )
            self.assertFalse(blocked, "rank 0's write waits for the stopped rank")
            out, blocked = _bounded(reader.read_all)
            self.assertFalse(blocked, "the controller's read waits for it")
            by_rank = {s.dp_rank: s.num_running_reqs for s in out["value"]}
            self.assertEqual(by_rank.get(0), 2)  # rank 0's new load is read
            self.assertNotIn(1, by_rank)  # the slot being written is skipped
        finally:
            release.set()
            child.join(60)
            if child.is_alive():
                child.kill()
        self.assertEqual(child.exitcode, 0)
        # Once rank 1's write is done its latest load is read again.
        by_rank = {s.dp_rank: s.num_running_reqs for s in reader.read_all()}
        self.assertEqual(by_rank, {0: 2, 1: 8})


if __name__ == "__main__":
    unittest.main()
