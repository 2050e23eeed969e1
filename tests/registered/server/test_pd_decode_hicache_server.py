"""PD disaggregation on CPU: a prefill server and a decode server with the
seed's decode-HiCache interface, KV moved by mooncake over TCP.

0.5.23 ships five transfer backends; on a CPU machine only ``mooncake_tcp``
(``mooncake-transfer-engine-non-cuda``, ``MC_FORCE_TCP``) moves KV: ``fake``
is refused by prefill servers, ``nixl`` registers the KV pool as VRAM (UCX
without CUDA refuses it), ``mori`` and ``ascend`` need ROCm / NPU.  Two CPU
gaps of the prefill's send path are bridged: the pinned-memory page-index
staging (``tests/standins/cpu_server.py``) and the early send of cached
prefixes, which records a ``torch.cuda.Event``
(``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=false``).

Requests are sent the way sglang's mini load balancer sends them: the same body
with ``bootstrap_host/port/room`` to both servers at once, the answer taken
from the decode server.  The decode worker runs DP=2 with
``--disaggregation-decode-enable-radix-cache --disaggregation-decode-enable-hicache
--disaggregation-decode-hicache-ratio 2.0``: it auto-selects cache_aware
routing, and a repeated prompt is served from the decode worker's own cache on
the rank that holds it.
"""

import random
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

from sglang.test.ci.ci_register import register_cpu_ci

from harness.live_server import LiveServer, assert_all_gone, free_port, greedy

register_cpu_ci(est_time=300, suite="base-b-test-cpu")
FEATURE_GROUP = "decode-hicache"  # the series group it tests (or "series")
PROJECT_ONLY = "runs this project's CPU server (stand-ins, local tiny model)"

PD_ENV = {
    # mooncake registers this address (else the first NIC's).
    "SGLANG_HOST_IP": "127.0.0.1",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "false",
}
TRANSFER = ["--disaggregation-transfer-backend", "mooncake_tcp"]
DECODE_ARGS = [
    "--disaggregation-mode",
    "decode",
    *TRANSFER,
    "--dp-size",
    "2",
    "--disaggregation-decode-enable-radix-cache",
    "--disaggregation-decode-enable-hicache",
    "--disaggregation-decode-hicache-ratio",
    "2.0",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "page_first_direct",
]
WORDS = "cache prefix token rank host device page layer tree radix decode".split()


def pd_generate(prefill, decode, bootstrap_port, text):
    body = {
        "text": text,
        "sampling_params": greedy(8),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.randint(0, 2**62),
    }
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.post_raw, "/generate", body)
        d = pool.submit(decode.post_raw, "/generate", body)
        p_resp, d_resp = p.result(), d.result()
    elapsed = time.perf_counter() - start
    assert p_resp.status_code == 200, p_resp.text[:500]
    assert d_resp.status_code == 200, d_resp.text[:500]
    return d_resp.json(), elapsed


class TestPdDecodeHiCacheServer(unittest.TestCase):
    results: dict = {}

    @classmethod
    def setUpClass(cls):
        rng = random.Random(3)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(2)]
        bootstrap_port = free_port()
        prefill_args = ["--disaggregation-mode", "prefill", *TRANSFER]
        prefill_args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        prefill = LiveServer("patched", prefill_args, env=PD_ENV, name="prefill")
        decode = None
        pids = []
        try:
            decode = LiveServer("patched", DECODE_ARGS, env=PD_ENV, name="decode")
            cls.results["server_info"] = decode.get("/server_info").json()
            runs = []
            for text in (prompts[0], prompts[1], prompts[0], prompts[1]):
                runs.append(pd_generate(prefill, decode, bootstrap_port, text))
            cls.results["runs"] = runs
        except Exception as exc:
            logs = prefill.log_tail(4000) + (decode.log_tail(6000) if decode else "")
            raise RuntimeError(f"{exc}\n{logs}") from exc
        finally:
            for server in (decode, prefill):
                if server is not None:
                    pids += server.stop()
        assert_all_gone(pids)

    def test_decode_dp_auto_selects_cache_aware(self):
        info = self.results["server_info"]
        self.assertEqual(info.get("dp_size"), 2)
        self.assertEqual(info.get("load_balance_method"), "cache_aware")
        self.assertTrue(info.get("enable_hierarchical_cache"))
        self.assertFalse(info.get("disable_radix_cache"))

    def test_repeated_prefix_served_from_decode_cache(self):
        runs = self.results["runs"]
        for i, (r, elapsed) in enumerate(runs):
            meta = r["meta_info"]
            print(
                f"request {i}: cached {meta['cached_tokens']}/{meta['prompt_tokens']}"
                f" rank {meta.get('dp_rank')} {elapsed:.2f} s"
            )
        for first, again in ((runs[0][0], runs[2][0]), (runs[1][0], runs[3][0])):
            self.assertEqual(first["meta_info"]["cached_tokens"], 0)
            meta = again["meta_info"]
            self.assertGreaterEqual(meta["cached_tokens"], meta["prompt_tokens"] - 1)
            self.assertEqual(meta["dp_rank"], first["meta_info"]["dp_rank"])
            self.assertEqual(again["output_ids"], first["output_ids"])


if __name__ == "__main__":
    unittest.main()
