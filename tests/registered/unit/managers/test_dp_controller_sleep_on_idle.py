"""``--sleep-on-idle`` must also quiet the DP controller.

The flag ("Reduce CPU usage when sglang is idle") makes each scheduler wait on
its sockets while it has nothing to do (``IdleSleeper``). In 0.5.23 the DP
controller of ``--dp-size N`` ignores it: its event loop polls the tokenizer's
socket without blocking, forever, so an idle server still burns a whole core.
Here the real ``run_data_parallel_controller_process`` runs in a process of its
own with scheduler stand-ins (CPU has no scheduler to spare): idle, with the
flag, it must use almost no CPU; and a message sent to it afterwards must
still reach every DP rank (the wait wakes on the socket, nothing is lost).
"""

import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")

DP_SIZE = 2
READY_TIMEOUT_S = 120.0  # the controller process imports sglang's scheduler stack
IDLE_WINDOW_S = 3.0
# A loop that waits on its socket wakes once a second; one that polls without
# blocking takes every cycle the machine gives it (a whole core when idle, and
# well over a tenth of one on a loaded two-core machine).
IDLE_CPU_LIMIT = 0.1
DELIVERY_TIMEOUT_S = 10.0
RECEIVED_DIR_ENV = "DP_IDLE_TEST_RECEIVED_DIR"


def _receiving_scheduler(
    server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank, pipe, *display
):
    """A scheduler stand-in: reports ready, then writes a file per message
    its DP rank's input socket receives."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(port_args.scheduler_input_ipc_name)
    pipe.send(
        {"status": "ready", "max_total_num_tokens": 4096, "max_req_input_len": 4096}
    )
    count = 0
    while True:
        sock.recv()
        count += 1
        path = os.path.join(os.environ[RECEIVED_DIR_ENV], f"rank{dp_rank}-{count}")
        with open(path, "w") as f:
            f.write("received")


def _controller(server_args, port_args, pipe_writer):
    from sglang.srt.managers.data_parallel_controller import (
        run_data_parallel_controller_process,
    )

    multiprocessing.set_start_method("fork", force=True)
    run_data_parallel_controller_process(
        server_args,
        port_args,
        pipe_writer,
        run_scheduler_process_func=_receiving_scheduler,
    )


def _kill_tree(pid):
    """SIGKILL ``pid`` first (the controller: its scheduler watchdog goes
    with it), then what was below it."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    for p in [pid] + [c.pid for c in below]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class TestDpControllerSleepOnIdle(unittest.TestCase):
    def test_an_idle_controller_waits_and_still_dispatches(self):
        import psutil
        import zmq
        from sglang.srt.arg_groups.serving_hook import handle_load_balance_method
        from sglang.srt.managers.io_struct import FlushCacheReqInput, sock_send
        from sglang.srt.server_args import PortArgs, ServerArgs

        received = tempfile.mkdtemp(prefix="dp-idle-")
        self.addCleanup(shutil.rmtree, received, True)
        os.environ[RECEIVED_DIR_ENV] = received
        self.addCleanup(os.environ.pop, RECEIVED_DIR_ENV, None)
        server_args = ServerArgs(
            model_path="dummy", dp_size=DP_SIZE, sleep_on_idle=True
        )
        handle_load_balance_method(server_args)
        port_args = PortArgs.init_new(server_args)
        # The tokenizer's end of the controller's input socket.
        ctx = zmq.Context()
        self.addCleanup(ctx.term)
        tokenizer = ctx.socket(zmq.PUSH)
        self.addCleanup(tokenizer.close, 0)
        tokenizer.bind(port_args.scheduler_input_ipc_name)

        mp = multiprocessing.get_context("fork")
        reader, writer = mp.Pipe(duplex=False)
        proc = mp.Process(target=_controller, args=(server_args, port_args, writer))
        proc.start()
        self.addCleanup(proc.join, 30)
        self.addCleanup(_kill_tree, proc.pid)
        self.assertTrue(reader.poll(READY_TIMEOUT_S), "the controller never got ready")
        self.assertEqual(reader.recv()["status"], "ready")

        controller = psutil.Process(proc.pid)
        time.sleep(1.0)  # past its start-up
        before = controller.cpu_times()
        time.sleep(IDLE_WINDOW_S)
        after = controller.cpu_times()
        used = (after.user - before.user) + (after.system - before.system)
        self.assertLess(
            used / IDLE_WINDOW_S,
            IDLE_CPU_LIMIT,
            f"the idle DP controller used {used:.2f} s of CPU in "
            f"{IDLE_WINDOW_S:g} s with --sleep-on-idle",
        )

        # Waiting loses nothing: a control message reaches every DP rank.
        sock_send(tokenizer, FlushCacheReqInput())
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        want = {f"rank{r}-1" for r in range(DP_SIZE)}
        while time.monotonic() < deadline and not want <= set(os.listdir(received)):
            time.sleep(0.05)
        self.assertEqual(set(os.listdir(received)), want)


if __name__ == "__main__":
    unittest.main()
