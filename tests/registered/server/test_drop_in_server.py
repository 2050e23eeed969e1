"""The patched wheel as a drop-in server: a real ``sglang serve`` over HTTP.

Three servers of the tiny local model on CPU, started together
(``harness.shared_servers``: the plain pristine and patched servers are the
ones the request fuzz uses too, when both files run in one session):
pristine upstream 0.5.23 and the patched wheel with every feature off run the
same greedy workload (the same forwards and the same bytes in every cached
prefix row they read, by ``harness.load_record``, then identical output token
ids and ``cached_tokens`` per request, and the same answers to bad requests,
after which a good request is served); then the patched wheel with HiCache and a device pool too small for
the workload, whose repeated prefixes come back from the host tier
(``cached_tokens_details.host``) with the outputs of the run without eviction.
"""

import random
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness import load_record, shared_servers
from harness.live_server import HICACHE_ARGS, greedy

register_cpu_ci(est_time=300, suite="base-b-test-cpu")
FEATURE_GROUP = "series"  # the series group it tests (or "series")

WORDS = (
    "cache prefix token rank host device page layer tree radix decode prefill "
    "router batch request server model kernel stream copy shard budget queue"
).split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def parity_prompts():
    rng = random.Random(11)
    a, b, c = (words(rng, 90) for _ in range(3))
    return [a, b, a + " decode", c, b + " radix tree", a + " decode page", "hi", c]


def eviction_prompts():
    """Ten 200-word prompts (~2000 tokens against a 1024-token device pool),
    then the first three again with a suffix: their prefixes were evicted to
    the host tier in between."""
    rng = random.Random(23)
    first = [words(rng, 200) for _ in range(10)]
    return first + [p + " shard" for p in first[:3]]


def run_greedy(server, prompts):
    out = []
    for text in prompts:
        r = server.generate({"text": text, "sampling_params": greedy(8)})
        meta = r["meta_info"]
        out.append(
            dict(
                output_ids=r["output_ids"],
                prompt_tokens=meta["prompt_tokens"],
                cached_tokens=meta["cached_tokens"],
                details=meta.get("cached_tokens_details") or {},
            )
        )
    return out


LONG_INPUT = {"input_ids": [5] * 5000, "sampling_params": greedy(2)}
BAD_REQUESTS = {
    "malformed_json": '{"text": "abc",',
    "longer_than_context": LONG_INPUT,
    "negative_max_new_tokens": {
        "text": "abc",
        "sampling_params": {"max_new_tokens": -1},
    },
    "unknown_sampling_param": {
        "text": "abc",
        "sampling_params": {"max_new_tokens": 2, "bogus": 1},
    },
    # /generate ignores unknown top-level fields (upstream answers 200).
    "unknown_field": {"text": "abc", "sampling_params": greedy(2), "bogus": 1},
}


def run_bad_requests(server):
    out = {}
    for name, body in BAD_REQUESTS.items():
        resp = server.post_raw("/generate", body)
        good = server.generate({"text": "page layer", "sampling_params": greedy(4)})
        out[name] = dict(status=resp.status_code, next_ok=len(good["output_ids"]))
    resp = server.post_raw(
        "/v1/completions",
        {"model": "m", "prompt": "abc", "max_tokens": -2},
    )
    good = server.generate({"text": "page layer", "sampling_params": greedy(4)})
    out["openai_negative_max_tokens"] = dict(
        status=resp.status_code, next_ok=len(good["output_ids"])
    )
    return out


def recorded(server, fn):
    """``fn()``, and what the server's load record logged meanwhile: each
    forward (``batches``) and the prefix rows attention read (``rows``)."""
    kinds = dict(batches="batches-rank", rows="rank")
    marks = {
        k: len(load_record.read(server.record_dir, 1, p)[0]) for k, p in kinds.items()
    }
    out = fn()
    return out, {
        k: load_record.read(server.record_dir, 1, p)[0][marks[k] :]
        for k, p in kinds.items()
    }


def plain(server):
    parity, record = recorded(server, lambda: run_greedy(server, parity_prompts()))
    return dict(
        parity=parity,
        parity_record=record,
        bad=run_bad_requests(server),
        eviction=run_greedy(server, eviction_prompts()),
    )


HICACHE_SERVER_ARGS = HICACHE_ARGS + [
    "--hicache-ratio",
    "4",
    "--max-total-tokens",
    "1024",
]
SERVERS = {
    "upstream": shared_servers.work("upstream", name="drop-in", fn=plain),
    "patched": shared_servers.work("patched", name="drop-in", fn=plain),
    "hicache": shared_servers.work(
        "patched",
        HICACHE_SERVER_ARGS,
        name="drop-in",
        fn=lambda s: run_greedy(s, eviction_prompts()),
    ),
}


class TestDropInServer(unittest.TestCase):
    runs: dict = {}

    @classmethod
    def setUpClass(cls):
        cls.runs = {
            name: shared_servers.result(k, "drop-in") for name, k in SERVERS.items()
        }

    def test_patched_matches_upstream(self):
        # The same forwards first (each request alone, in order: the flush
        # before the work waited out the start's health checks), then the
        # same bytes in every cached prefix row they read, then the outputs.
        records = [self.runs[k]["parity_record"] for k in ("upstream", "patched")]
        self.assertTrue(records[1]["batches"], "no forward recorded")
        self.assertEqual(records[0]["batches"], records[1]["batches"], "batches")
        self.assertTrue(records[1]["rows"], "no cached prefix read")
        self.assertEqual(records[0]["rows"], records[1]["rows"], "prefix rows")
        up, ours = self.runs["upstream"]["parity"], self.runs["patched"]["parity"]
        self.assertEqual(len(up), len(parity_prompts()))
        for i, (a, b) in enumerate(zip(up, ours)):
            self.assertEqual(a["output_ids"], b["output_ids"], f"request {i}")
            self.assertEqual(a["cached_tokens"], b["cached_tokens"], f"request {i}")
            self.assertEqual(a["prompt_tokens"], b["prompt_tokens"], f"request {i}")
        # The workload discriminates: repeated prefixes are served from cache.
        self.assertGreaterEqual(ours[2]["cached_tokens"], ours[0]["prompt_tokens"] - 1)
        self.assertEqual(ours[0]["cached_tokens"], 0)
        self.assertEqual(
            [r["output_ids"] for r in self.runs["upstream"]["eviction"]],
            [r["output_ids"] for r in self.runs["patched"]["eviction"]],
        )

    def test_bad_requests_answered_like_upstream(self):
        up, ours = self.runs["upstream"]["bad"], self.runs["patched"]["bad"]
        self.assertEqual(up, ours)
        for name, r in ours.items():
            if name == "unknown_field":
                self.assertEqual(r["status"], 200)
            else:
                self.assertTrue(400 <= r["status"] < 500, (name, r))
            self.assertGreater(r["next_ok"], 0, name)  # the next request is served

    def test_hicache_host_hits_under_eviction(self):
        plain = self.runs["patched"]["eviction"]
        evicting = self.runs["hicache"]
        self.assertEqual(
            [r["output_ids"] for r in evicting], [r["output_ids"] for r in plain]
        )
        host = [r["details"].get("host", 0) for r in evicting]
        repeats = evicting[-3:]
        self.assertTrue(all(h > 0 for h in host[-3:]), host)
        for r in repeats:
            self.assertGreaterEqual(r["cached_tokens"], r["prompt_tokens"] - 2)
        # Without the small pool nothing comes from the host tier.
        self.assertEqual(sum(r["details"].get("host", 0) for r in plain), 0)


if __name__ == "__main__":
    unittest.main()
