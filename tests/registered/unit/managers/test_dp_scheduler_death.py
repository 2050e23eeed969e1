"""A DP rank's scheduler that dies must stop the server, not leave it hung.

With ``--dp-size N`` (no DP attention) the launcher starts one process, the DP
controller, and the controller starts every DP rank's schedulers. The
launcher's subprocess watchdog watches only its own children; in 0.5.23 the
controller watches nobody, so a scheduler killed by the kernel (OOM killer, a
segfault in a kernel, an operator's ``kill -9``) leaves the controller routing
requests to a dead rank: every request on that rank, and every later one
routed there, waits forever, and the server never exits. Here the real
``run_data_parallel_controller_process`` runs in a process of its own (this
test is its launcher) with scheduler stand-ins; one stand-in is killed and the
controller must send its launcher SIGQUIT, as a scheduler that raises does,
which makes the launcher stop the whole tree.
"""

import multiprocessing
import os
import signal
import time
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")

DP_SIZE = 2
READY_TIMEOUT_S = 120.0  # the controller process imports sglang's scheduler stack
DEADLINE_S = 15.0  # the watchdog polls every second; never means forever


def _idle_scheduler(
    server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe, *display
):
    """A scheduler that starts, reports ready and serves nothing."""
    pipe.send(
        {"status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": 4096}
    )
    while True:
        time.sleep(3600)


def _controller(server_args, port_args, pipe_writer):
    from sglang.srt.managers.data_parallel_controller import (
        run_data_parallel_controller_process,
    )

    # As a launcher on Linux starts it: the controller forks its schedulers.
    multiprocessing.set_start_method("fork", force=True)
    run_data_parallel_controller_process(
        server_args, port_args, pipe_writer, run_scheduler_process_func=_idle_scheduler
    )


def _pids(pid):
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class TestDpSchedulerDeath(unittest.TestCase):
    def setUp(self):
        # SIGQUIT is what the controller sends; blocked here and taken with
        # sigtimedwait, so a stray one cannot end the test process.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGQUIT})
        self.addCleanup(signal.pthread_sigmask, signal.SIG_UNBLOCK, {signal.SIGQUIT})
        self.addCleanup(self._drain_sigquit)

    @staticmethod
    def _drain_sigquit():
        while signal.sigtimedwait({signal.SIGQUIT}, 0) is not None:
            pass

    def _start_controller(self):
        from sglang.srt.arg_groups.serving_hook import handle_load_balance_method
        from sglang.srt.managers.data_parallel_controller import SCHEDULER_PIDS_ARG
        from sglang.srt.server_args import PortArgs, ServerArgs

        server_args = ServerArgs(model_path="dummy", dp_size=DP_SIZE)
        handle_load_balance_method(server_args)
        port_args = PortArgs.init_new(server_args)
        ctx = multiprocessing.get_context("fork")
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_controller, args=(server_args, port_args, writer))
        proc.start()
        self.addCleanup(self._stop, proc)
        self.assertTrue(reader.poll(READY_TIMEOUT_S), "the controller never got ready")
        info = reader.recv()
        self.assertEqual(info["status"], "ready", info)
        return proc, info[SCHEDULER_PIDS_ARG]

    @staticmethod
    def _stop(proc):
        tree = _pids(proc.pid)
        proc.kill()  # the controller first: its watchdog goes with it
        proc.join(30)
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def test_a_killed_scheduler_signals_the_launcher(self):
        proc, schedulers = self._start_controller()
        self.assertEqual(len(schedulers), DP_SIZE)
        # Nothing is wrong yet: no signal while every scheduler lives.
        self.assertIsNone(signal.sigtimedwait({signal.SIGQUIT}, 2.0))
        os.kill(schedulers[1], signal.SIGKILL)
        start = time.monotonic()
        got = signal.sigtimedwait({signal.SIGQUIT}, DEADLINE_S)
        self.assertIsNotNone(
            got,
            f"DP rank 1's scheduler was killed and the DP controller did not "
            f"tell its launcher within {DEADLINE_S:g} s: the server would hang",
        )
        self.assertEqual(got.si_pid, proc.pid)  # sent by the controller
        print(f"SIGQUIT {time.monotonic() - start:.2f} s after the kill")
        self.assertTrue(proc.is_alive())  # the launcher stops the tree


if __name__ == "__main__":
    unittest.main()
