"""Bad configuration stops ``python -m sglang.launch_server`` at startup.

Each case runs the drop-in launcher of the patched wheel on CPU (the tiny
local model, 127.0.0.1) and checks: a non-zero exit, a message naming the flag
or variable, no worker ever started (the refusal comes from server-args
resolution, before the scheduler is spawned), and no process of that launch
left behind.
"""

import json
import re
import socket
import subprocess
import sys
import time
import unittest
import uuid

import psutil
from sglang.test.ci.ci_register import register_cpu_ci

from harness.live_server import HICACHE_ARGS, cpu_server, free_port, model_path

register_cpu_ci(est_time=90, suite="base-b-test-cpu")
FEATURE_GROUP = "series"  # the series group it tests (or "series")

# A refusal needs only the launcher's imports (tens of seconds on 2 busy cores).
REFUSAL_TIMEOUT_S = 180


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A Mooncake master address nothing listens on (0.5.23: each scheduler's setup
# retries ~100 s, then dies with "error code: -1").
NO_MASTER = f"127.0.0.1:{closed_port()}"
CASES = {
    "decode_flag_on_non_decode_server": (
        ["--disaggregation-decode-enable-hicache"],
        {},
        ["--disaggregation-decode-enable-hicache"],
    ),
    "cache_aware_without_radix_cache": (
        ["--dp-size", "2", "--load-balance-method", "cache_aware"]
        + ["--disable-radix-cache"],
        {},
        ["cache_aware", "--disable-radix-cache"],
    ),
    "rank_shard_switch_not_a_boolean": (
        HICACHE_ARGS,
        {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "abc"},
        ["SGLANG_ENABLE_HICACHE_RANK_SHARD", "abc", "accepted"],
    ),
    "mooncake_master_nobody_listens_on": (
        HICACHE_ARGS
        + ["--hicache-storage-backend", "mooncake"]
        + ["--hicache-storage-backend-extra-config"]
        + [json.dumps({"master_server_address": NO_MASTER, "protocol": "tcp"})],
        {},
        ["master_server_address", NO_MASTER],
    ),
    "rank_shard_knob_not_an_integer": (
        HICACHE_ARGS,
        {
            "SGLANG_ENABLE_HICACHE_RANK_SHARD": "1",
            "SGLANG_HICACHE_RANK_SHARD_STAGING_MB": "lots",
        },
        ["SGLANG_HICACHE_RANK_SHARD_STAGING_MB", "lots"],
    ),
}


def tagged_processes(tag: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("SGL_LIVE_TEST_TAG") == tag:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def launch(extra, env_extra):
    tag = uuid.uuid4().hex
    env = cpu_server.server_env(extra)
    env.update(env_extra, SGL_LIVE_TEST_TAG=tag)
    cmd = [sys.executable, "-m", "sglang.launch_server"]
    cmd += cpu_server.server_args(model_path(), free_port(), extra)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=REFUSAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        cpu_server.stop_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"no refusal within {REFUSAL_TIMEOUT_S} s:\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - start, tag


class TestStartupRefusals(unittest.TestCase):
    def test_refusals(self):
        for name, (extra, env, needles) in CASES.items():
            with self.subTest(name):
                rc, out, elapsed, tag = launch(extra, env)
                print(f"{name}: exit {rc} after {elapsed:.1f} s")
                tail = out[-3000:]
                self.assertNotEqual(rc, 0, tail)
                for needle in needles:
                    self.assertIn(needle, tail, f"{name}: {needle!r} not named")
                # no scheduler logged a line (each prefixes its rank: "TP0]")
                self.assertIsNone(
                    re.search(r" (?:DP\d+ )?TP\d+\]", out), "a worker started"
                )
                # the launcher has exited; its children get a bounded time to follow
                deadline = time.monotonic() + 30
                while tagged_processes(tag) and time.monotonic() < deadline:
                    time.sleep(0.2)
                self.assertEqual(tagged_processes(tag), [], "left behind")


if __name__ == "__main__":
    unittest.main()
