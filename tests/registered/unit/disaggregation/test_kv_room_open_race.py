"""A PD prefill must not lose the decode's bootstrap that reaches it while it
opens the request's bootstrap room.

A PD router posts a request to the prefill and the decode server at once.
The prefill's scheduler thread opens the request's room when it creates the
KV sender (``update_status(room, Bootstrapping)``); the decode's pre-allocated
destination reaches the prefill's bootstrap thread, which records it and
marks the room ``WaitingForInput`` (``update_status(room, WaitingForInput)``).
0.5.23's ``CommonKVManager.update_status`` reads the room and writes it back
with no lock: when the scheduler thread is switched out between its read (no
room yet) and its write, the bootstrap thread's ``WaitingForInput`` is
overwritten with ``Bootstrapping``, and nothing sets it again. The prefill
keeps the request in its bootstrap queue until its bootstrap timeout (300 s)
while the decode waits for the KV in its transfer queue, neither logging a
line: the intermittent stall of the live PD test.

Both threads run the real ``update_status`` of one manager; the first is held
right after its read of the room, as a thread switch holds it, until the
second has finished or ``HOLD_S`` passed (when the second cannot run in
between). The room must end ``WaitingForInput`` in either order, and a
decode's abort (``Failed``) must not be undone by a late opening.
"""

import threading
import unittest
from collections import defaultdict

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_bootstrap_then_sender": "the sender's later Bootstrapping never lowered it",
    "test_abort_then_sender": "Failed is terminal, read or not",
}

ROOM = 1639386246586197803
HOLD_S = 1.0  # how long the first thread stays switched out after its read


class HeldAfterRead(dict):
    """``request_status`` whose first read of ``room`` by ``holder`` returns
    what it read only once ``release`` is set or ``HOLD_S`` passed."""

    def __init__(self, room: int, holder: threading.Thread):
        super().__init__()
        self.room, self.holder = room, holder
        self.read = threading.Event()
        self.release = threading.Event()

    def get(self, key, default=None):
        value = super().get(key, default)
        holding = threading.current_thread() is self.holder and not self.read.is_set()
        if key == self.room and holding:
            self.read.set()
            self.release.wait(HOLD_S)
        return value


def manager():
    """A ``CommonKVManager`` with the state ``update_status`` reads (its
    ``__init__`` binds sockets and registers with a bootstrap server)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    mgr = object.__new__(CommonKVManager)
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr._staging_outstanding = defaultdict(int)
    mgr.deferred_bootstrap = None
    return mgr


def race(first_status, second_status):
    """The room's status after ``first_status`` is written by a thread held
    after its read and ``second_status`` by another thread meanwhile."""
    mgr = manager()
    first = threading.Thread(target=mgr.update_status, args=(ROOM, first_status))
    table = HeldAfterRead(ROOM, first)
    mgr.request_status = table
    second_done = threading.Event()

    def second_run():
        mgr.update_status(ROOM, second_status)
        second_done.set()

    second = threading.Thread(target=second_run)
    first.start()
    assert table.read.wait(30), "the first update never read the room"
    second.start()
    second_done.wait(HOLD_S)  # upstream: done at once; a lock: blocked
    table.release.set()
    for thread in (first, second):
        thread.join(30)
        assert not thread.is_alive(), "an update_status never returned"
    return dict.__getitem__(table, ROOM)


class TestKvRoomOpenRace(unittest.TestCase):
    def setUp(self):
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.poll = KVPoll

    def test_sender_then_bootstrap(self):
        # the sender's opening read, then the decode's destination recorded:
        # 0.5.23 ends Bootstrapping, the request stranded in the bootstrap queue
        status = race(self.poll.Bootstrapping, self.poll.WaitingForInput)
        self.assertEqual(status, self.poll.WaitingForInput)

    def test_bootstrap_then_sender(self):
        status = race(self.poll.WaitingForInput, self.poll.Bootstrapping)
        self.assertEqual(status, self.poll.WaitingForInput)

    def test_abort_then_sender(self):
        # Failed (the decode's abort) is terminal: a late opening keeps it
        mgr = manager()
        mgr.request_status = {}
        mgr.update_status(ROOM, self.poll.Bootstrapping)
        mgr.update_status(ROOM, self.poll.Failed)
        mgr.update_status(ROOM, self.poll.WaitingForInput)
        self.assertEqual(mgr.request_status[ROOM], self.poll.Failed)


if __name__ == "__main__":
    unittest.main()
