"""A crashing server waits for CUDA coredumps only when it triggered one.

When a child of the server fails, the launcher's SIGQUIT handler runs
``TokenizerManager.dump_requests_before_crash`` before it stops the process
tree: by default it asks every live scheduler for a CUDA user-triggered
coredump (``SGLANG_CUDA_COREDUMP_BEFORE_CRASH``) and then waits
``SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS`` (60 s) for the dumps. 0.5.23
waits even when no dump was triggered: no scheduler has a coredump pipe
unless ``CUDA_ENABLE_USER_TRIGGERED_COREDUMP=1`` was set before CUDA started
(the default, and always on CPU), so a server whose DP rank died kept every
client of the surviving ranks waiting a minute for nothing, with the event
loop blocked. Here a live process titled as a scheduler has no coredump pipe:
the dump must not wait; with a pipe (a FIFO with a reader) it is triggered
and waited for.
"""

import os
import shutil
import subprocess
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_a_triggered_coredump_is_waited_for": "with a coredump pipe upstream waits too"
}

SETTLE_S = 5  # the sleep before any crash diagnostics
WAIT_S = 60.0  # SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS's default


class TestCrashCoredumpWait(unittest.TestCase):
    def setUp(self):
        self.pipes = tempfile.mkdtemp()
        env = {
            "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
            "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "1",
            "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": str(WAIT_S),
            "CUDA_COREDUMP_PIPE": os.path.join(self.pipes, "corepipe.%p"),
        }
        patcher = mock.patch.dict(os.environ, env)
        patcher.start()
        self.addCleanup(patcher.stop)
        # A live child with a scheduler's process title (what setproctitle
        # gives a real one) and no CUDA context.
        self.scheduler = subprocess.Popen(
            ["sglang::scheduler_TP0", "3600"], executable=shutil.which("sleep")
        )
        self.addCleanup(self.scheduler.wait, 30)
        self.addCleanup(self.scheduler.kill)

    def dump(self) -> list:
        """The sleeps of one crash dump (recorded, not slept)."""
        from sglang.srt.managers import tokenizer_manager
        from sglang.srt.utils.cudacore_pyspy_dump_utils import (
            collect_scheduler_processes,
        )

        self.assertEqual(
            [p.pid for p in collect_scheduler_processes()], [self.scheduler.pid]
        )
        manager = object.__new__(tokenizer_manager.TokenizerManager)
        manager.crash_dump_folder = None
        manager.crash_dump_performed = False
        sleeps = []
        fake_time = SimpleNamespace(sleep=sleeps.append)
        with mock.patch.object(tokenizer_manager, "time", fake_time):
            manager.dump_requests_before_crash()
        return sleeps

    def test_no_coredump_pipe_no_wait(self):
        self.assertEqual(
            self.dump(),
            [SETTLE_S],
            "no coredump was triggered, yet the crash waits for one",
        )

    def test_a_triggered_coredump_is_waited_for(self):
        # Control: the scheduler's pipe exists and has a reader.
        pipe = os.path.join(self.pipes, f"corepipe.{self.scheduler.pid}")
        os.mkfifo(pipe)
        reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
        try:
            self.assertEqual(self.dump(), [SETTLE_S, WAIT_S])
            self.assertEqual(os.read(reader, 16), b"1")  # the trigger
        finally:
            os.close(reader)


if __name__ == "__main__":
    unittest.main()
