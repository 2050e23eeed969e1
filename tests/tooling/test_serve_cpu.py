"""``make serve-cpu``: a DP=2 server whose DP rank 1 scheduler is SIGKILLed
under 8 streams ends every stream (the dead rank's in an error, none hangs),
exits with its whole tree and frees its port; on that port the README's
rank-shard command (a TP=2 tiny DeepSeek-V3.2 with HiCache and
``SGLANG_ENABLE_HICACHE_RANK_SHARD=1``) then starts and serves the README's
example request and ``scripts/host_tier_demo.py``'s host-tier hit with rank
shard active, and SIGTERM to its process group during 8 streams ends each
stream (finished, or cut at the grace), stops the launcher within its grace
and leaves no process behind."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import unittest
from pathlib import Path

import psutil
import requests

from harness.faults import Streams, kill_during_streams
from harness.live_server import (
    START_TIMEOUT_S,
    cpu_server,
    free_port,
    port_release,
    process_roles,
    wait_gone,
)
from harness.metrics import scrape

ROOT = Path(__file__).resolve().parent.parent.parent


def readme_example() -> dict:
    """The JSON body of the README's ``curl .../generate`` example."""
    text = (ROOT / "README.md").read_text()
    match = re.search(
        r"curl -s 127\.0\.0\.1:30000/generate .*?-d '(\{.*?\})'", text, re.S
    )
    assert match, "README has no serve-cpu example request"
    return json.loads(match.group(1))


def readme_rank_shard_command() -> tuple[dict, str, str, list[str]]:
    """(environment, MODEL, L3, SERVER_ARGS) of the README's rank-shard command."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    match = re.search(
        r"^(\w+=\S+) make serve-cpu MODEL=(\S+) (?:L3=(\S+) )?"
        r"SERVER_ARGS=\"([^\"]*)\"",
        text,
        re.M,
    )
    assert match, "README has no rank-shard serve-cpu command"
    name, _, value = match.group(1).partition("=")
    return (
        {name: value},
        match.group(2),
        match.group(3) or "none",
        match.group(4).split(),
    )


class TestServeCpu(unittest.TestCase):
    def test_make_target_runs_the_cpu_server(self):
        out = subprocess.run(
            ["make", "-n", "serve-cpu", "PORT=31234", "SERVER_ARGS=--dp-size 2"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        self.assertIn(
            "scripts/cpu_server.py --port 31234 --model tiny-llama --l3 none -- "
            "--dp-size 2",
            out,
        )

    def test_scheduler_death_then_the_readme_server_on_its_port(self):
        port = free_port()
        self.dp_rank_death(port)
        self.readme_server_and_sigterm(port)

    def dp_rank_death(self, port):
        proc = serve(port, "tiny-llama", ["--dp-size", "2"])
        try:
            wait_healthy(proc, port, START_TIMEOUT_S[2])
            tree = [proc.pid] + [
                c.pid for c in psutil.Process(proc.pid).children(recursive=True)
            ]
            victim = process_roles(proc.pid)["sglang::scheduler_DP1"]
            fault = kill_during_streams(
                f"http://127.0.0.1:{port}", tree, victim, FAULT_TOKENS
            )
            rc = proc.wait(FAULT_BOUND_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        print(f"DP rank kill: {fault}")
        streams = fault["streams"]
        ranks = {s.get("dp_rank") for s in streams} - {None}
        self.assertEqual(ranks, {0, 1}, streams)
        # The dead rank's streams fail (and any still queued); the survivor's
        # finish or are cut when the tree stops; none is left waiting.
        for s in streams:
            self.assertIn(s["state"], ("done", "error"), output[-3000:])
            if s.get("dp_rank") in (1, None):
                self.assertEqual(s["state"], "error", s)
        self.assertIsNotNone(fault["clients_s"], output[-3000:])
        self.assertLess(fault["clients_s"], FAULT_BOUND_S, fault)
        self.assertEqual(fault["left"], [], output[-3000:])
        self.assertIsNotNone(fault["tree_s"], fault)
        self.assertIn("Subprocess scheduler_DP1_TP0", output)
        self.assertNotEqual(rc, 0)  # the launcher stopped itself on a crash
        released = port_release(port)
        self.assertTrue(released["free"], released)

    def readme_server_and_sigterm(self, port):
        env, model, l3, args = readme_rank_shard_command()
        self.assertEqual(l3, "mooncake")
        proc = serve(port, model, args, env, l3=l3)
        tree = []
        try:
            wait_healthy(proc, port, START_TIMEOUT_S[2])
            body = readme_example()
            resp = requests.post(
                f"http://127.0.0.1:{port}/generate", json=body, timeout=120
            )
            self.assertEqual(resp.status_code, 200, resp.text[:500])
            want = body["sampling_params"]["max_new_tokens"]
            self.assertEqual(len(resp.json()["output_ids"]), want)
            demo = subprocess.run(
                [sys.executable, "scripts/host_tier_demo.py", "--port", str(port)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
            self.assertEqual(demo.returncode, 0, demo.stdout + demo.stderr)
            # 400-token prompt, DSA pages of 64: 6 whole pages from the host
            self.assertRegex(
                demo.stdout, r"revisit: \d+ tokens, cached \{'device': 0, 'host': 384"
            )
            # and every page of the demo's prompts went to the Mooncake store,
            # each rank its own shard objects (hicache-rank-shard 0015)
            written = l3_written(port)
            self.assertEqual(sorted(written), [0, 1], written)
            self.assertTrue(all(written.values()), written)
            tree = [proc.pid] + [
                c.pid for c in psutil.Process(proc.pid).children(recursive=True)
            ]
            self.assertGreaterEqual(len(tree), 3)  # wrapper, launcher, workers
            cmdlines = [" ".join(psutil.Process(p).cmdline()) for p in tree]
            # Requests still generating when SIGTERM arrives: each is answered
            # in full or cut at the grace, none hangs.
            streams = Streams(f"http://127.0.0.1:{port}", 8, SIGTERM_TOKENS)
            streams.wait_started(every=False)  # some may wait in the queue
        finally:
            sigterm_at = time.monotonic()
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=SERVE_STOP_GRACE_S + 90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                self.fail("serve-cpu did not stop on SIGTERM")
        stopped_s = time.monotonic() - sigterm_at
        self.assertEqual(proc.returncode, 0, output[-3000:])
        # upstream's drain ran (it looks every 5 s: short streams may be done)
        self.assertRegex(output, r"Remaining number of requests \d+")
        for rank, layers in ((0, "[0, 2]"), (1, "[1, 3]")):
            self.assertIn(
                f"HiCache rank shard: rank {rank}/2 owns KV layers {layers} and "
                f"indexer layers {layers}",
                output,
            )
        streams.join(30)
        outcomes = streams.summary(sigterm_at)
        print(f"SIGTERM under 8 streams: stopped in {stopped_s:.1f} s, {outcomes}")
        for o in outcomes:
            self.assertIn(o["state"], ("done", "error"), (o, output[-3000:]))
        # The launcher drains for at most its grace, then the rest is killed.
        self.assertLess(stopped_s, SERVE_STOP_GRACE_S + 15, output[-3000:])
        self.assertEqual(wait_gone(tree, 30), [], "left behind after SIGTERM")
        # the store was started with the server and stopped after it
        self.assertIn("Mooncake store setup successfully", output)
        self.assertIn("mooncake store stopped: {'held_ports': []}", output)
        for part in ("mooncake_master", "mooncake_client"):
            self.assertTrue(any(part in c for c in cmdlines), (part, cmdlines))


# 8 streams at once in the README server's 1024-token pool of 64-token DSA
# pages: one page each (prompt + 48 tokens), so none waits in the queue.
SIGTERM_TOKENS = 48
FAULT_BOUND_S = 60.0  # kill to every client answered and the tree gone
FAULT_TOKENS = 1000  # 8 of them fit the default 16384-token pool per DP rank
SERVE_STOP_GRACE_S = cpu_server.SERVE_STOP_GRACE_S  # its default --stop-grace


def l3_written(port) -> dict:
    """TP rank -> bytes its rank-sharded L3 objects took (written)."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    series = scrape(text, "sglang:hicache_rank_shard_l3_bytes_total")
    return {
        int(dict(labels)["tp_rank"]): value
        for labels, value in series.items()
        if dict(labels)["direction"] == "written"
    }


def serve(port, model, args, env=None, l3="none"):
    """``make serve-cpu`` (scripts/cpu_server.py) in its own process group,
    like a terminal job."""
    return subprocess.Popen(
        [sys.executable, "scripts/cpu_server.py", "--port", str(port)]
        + ["--model", model, "--l3", l3, "--", *args],
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_healthy(proc, port, timeout):
    # /health_generate: a DP server answers /health before its ranks serve
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            url = f"http://127.0.0.1:{port}/health_generate"
            if requests.get(url, timeout=5).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"serve-cpu not healthy (exit code {proc.poll()})")


if __name__ == "__main__":
    unittest.main()
