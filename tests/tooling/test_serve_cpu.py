"""``make serve-cpu``: the README's rank-shard command (a TP=2 tiny DeepSeek-V3.2
with HiCache and ``SGLANG_ENABLE_HICACHE_RANK_SHARD=1``) serves the README's
example request and ``scripts/host_tier_demo.py``'s host-tier hit with rank
shard active, and SIGTERM to its process group answers the request in flight
and leaves no process behind."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
from pathlib import Path

import psutil
import requests

from harness.live_server import START_TIMEOUT_S, free_port

ROOT = Path(__file__).resolve().parent.parent.parent


def readme_example() -> dict:
    """The JSON body of the README's ``curl .../generate`` example."""
    text = (ROOT / "README.md").read_text()
    match = re.search(
        r"curl -s 127\.0\.0\.1:30000/generate .*?-d '(\{.*?\})'", text, re.S
    )
    assert match, "README has no serve-cpu example request"
    return json.loads(match.group(1))


def readme_rank_shard_command() -> tuple[dict, str, list[str]]:
    """(environment, MODEL, SERVER_ARGS) of the README's rank-shard command."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    match = re.search(
        r"^(\w+=\S+) make serve-cpu MODEL=(\S+) SERVER_ARGS=\"([^\"]*)\"", text, re.M
    )
    assert match, "README has no rank-shard serve-cpu command"
    name, _, value = match.group(1).partition("=")
    return {name: value}, match.group(2), match.group(3).split()


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
            "scripts/cpu_server.py --port 31234 --model tiny-llama -- --dp-size 2", out
        )

    def test_example_request_and_sigterm(self):
        port = free_port()
        env, model, args = readme_rank_shard_command()
        proc = subprocess.Popen(
            [sys.executable, "scripts/cpu_server.py", "--port", str(port)]
            + ["--model", model, "--", *args],
            cwd=ROOT,
            env=dict(os.environ, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, like a terminal job
        )
        tree = []
        try:
            deadline = time.monotonic() + START_TIMEOUT_S[2]
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).ok:
                        break
                except requests.RequestException:
                    pass
                time.sleep(0.5)
            self.assertIsNone(proc.poll(), "serve-cpu exited")
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
                demo.stdout, r"revisit: \d+ tokens, cached \{'device': 0, 'host': 384\}"
            )
            tree = [proc.pid] + [
                c.pid for c in psutil.Process(proc.pid).children(recursive=True)
            ]
            self.assertGreaterEqual(len(tree), 3)  # wrapper, launcher, workers
            # A request still generating when SIGTERM arrives is answered:
            # streamed, so its first event says it is running.
            in_flight = {}
            started = threading.Event()

            def long_request():
                body = {
                    "text": "the cache prefix",
                    "stream": True,
                    "sampling_params": {
                        "temperature": 0,
                        "max_new_tokens": IN_FLIGHT_TOKENS,
                        "ignore_eos": True,
                    },
                }
                with requests.post(
                    f"http://127.0.0.1:{port}/generate",
                    json=body,
                    stream=True,
                    timeout=120,
                ) as r:
                    in_flight["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            started.set()
                            event = json.loads(line[len(b"data: ") :])
                            in_flight["tokens"] = event["meta_info"][
                                "completion_tokens"
                            ]
                        elif line == b"data: [DONE]":
                            in_flight["done"] = True
                started.set()

            client = threading.Thread(target=long_request)
            client.start()
            self.assertTrue(started.wait(60), "the long request never started")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                self.fail("serve-cpu did not stop on SIGTERM")
        self.assertEqual(proc.returncode, 0, output[-3000:])
        # upstream's drain found the streamed request still running
        self.assertIn("Remaining number of requests 1", output)
        for rank, layers in ((0, "[0, 2]"), (1, "[1, 3]")):
            self.assertIn(
                f"HiCache rank shard: rank {rank}/2 owns KV layers {layers} and "
                f"indexer layers {layers}",
                output,
            )
        client.join(120)
        self.assertEqual(
            in_flight,
            {"status": 200, "tokens": IN_FLIGHT_TOKENS, "done": True},
            output[-3000:],
        )
        deadline = time.monotonic() + 30
        alive = tree
        while alive and time.monotonic() < deadline:
            alive = [p for p in tree if psutil.pid_exists(p) and not _zombie(p)]
            time.sleep(0.5)
        self.assertEqual(alive, [], "left behind after SIGTERM")


IN_FLIGHT_TOKENS = 96  # TP=2 decodes ~7-30 tokens/s on 2 CPU cores


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


if __name__ == "__main__":
    unittest.main()
