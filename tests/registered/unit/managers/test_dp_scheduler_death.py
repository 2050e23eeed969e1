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
which makes the launcher stop the whole tree. The launcher is a helper child
of the test process: the SIGQUIT never reaches pytest.
"""

import ctypes
import multiprocessing
import os
import signal
import time
import traceback
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


def _stop_tree(proc):
    tree = _pids(proc.pid)
    proc.kill()  # the parent first: a watchdog goes with it
    proc.join(30)
    _kill(tree)


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _launcher(conn, server_args, port_args):
    """The launcher: a helper child of the test process, never the test
    process itself, so that no SIGQUIT reaches pytest. It blocks SIGQUIT and
    takes it with sigtimedwait, starts the controller as its child, and
    answers the test's ``("wait", seconds)`` with the SIGQUIT it got (its
    sender) or None, until ``("stop", None)``."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGQUIT})
    try:  # gone with the test process
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_controller, args=(server_args, port_args, writer))
    try:
        proc.start()
        if not reader.poll(READY_TIMEOUT_S):
            conn.send(("not ready", proc.pid, None))
        else:
            conn.send(("ready", proc.pid, reader.recv()))
        while True:
            cmd, seconds = conn.recv()
            if cmd == "stop":
                break
            got = signal.sigtimedwait({signal.SIGQUIT}, seconds)
            conn.send(
                None
                if got is None
                else dict(si_pid=got.si_pid, controller_alive=proc.is_alive())
            )
    except BaseException:
        conn.send(("error", None, traceback.format_exc()))
    finally:
        if proc.pid is not None:
            _stop_tree(proc)
        conn.send("stopped")


class TestDpSchedulerDeath(unittest.TestCase):
    def _start_controller(self):
        """The controller under a helper launcher; (its pid, the scheduler
        pids, the launcher's end of the pipe)."""
        from sglang.srt.arg_groups.serving_hook import handle_load_balance_method
        from sglang.srt.managers.data_parallel_controller import SCHEDULER_PIDS_ARG
        from sglang.srt.server_args import PortArgs, ServerArgs

        server_args = ServerArgs(model_path="dummy", dp_size=DP_SIZE)
        handle_load_balance_method(server_args)
        port_args = PortArgs.init_new(server_args)
        ctx = multiprocessing.get_context("fork")
        conn, child = ctx.Pipe()
        launcher = ctx.Process(target=_launcher, args=(child, server_args, port_args))
        launcher.start()
        self.addCleanup(_stop_tree, launcher)
        self.addCleanup(self._stop, conn)
        self.assertTrue(conn.poll(READY_TIMEOUT_S + 30), "the launcher never answered")
        status, controller, info = conn.recv()
        if status == "error":
            raise RuntimeError(f"the launcher failed:\n{info}")
        self.assertEqual(status, "ready", "the controller never got ready")
        self.assertEqual(info["status"], "ready", info)
        # by pid: the controller and its schedulers are not this process's
        # children
        self.addCleanup(_kill, [controller, *info[SCHEDULER_PIDS_ARG]])
        return controller, info[SCHEDULER_PIDS_ARG], conn

    @staticmethod
    def _stop(conn):
        try:
            conn.send(("stop", None))
            while conn.poll(30) and conn.recv() != "stopped":
                pass
        except (OSError, EOFError):
            pass

    @staticmethod
    def _sigquit(conn, seconds):
        """The SIGQUIT the launcher got within ``seconds``, or None."""
        conn.send(("wait", seconds))
        if not conn.poll(seconds + 30):
            raise RuntimeError("the launcher did not answer")
        return conn.recv()

    def test_a_killed_scheduler_signals_the_launcher(self):
        controller, schedulers, conn = self._start_controller()
        self.assertEqual(len(schedulers), DP_SIZE)
        # Nothing is wrong yet: no signal while every scheduler lives.
        self.assertIsNone(self._sigquit(conn, 2.0))
        os.kill(schedulers[1], signal.SIGKILL)
        start = time.monotonic()
        got = self._sigquit(conn, DEADLINE_S)
        self.assertIsNotNone(
            got,
            f"DP rank 1's scheduler was killed and the DP controller did not "
            f"tell its launcher within {DEADLINE_S:g} s: the server would hang",
        )
        self.assertEqual(got["si_pid"], controller)  # sent by the controller
        print(f"SIGQUIT {time.monotonic() - start:.2f} s after the kill")
        self.assertTrue(got["controller_alive"])  # the launcher stops the tree


if __name__ == "__main__":
    unittest.main()
