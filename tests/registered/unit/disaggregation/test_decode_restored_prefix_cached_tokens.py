"""A PD decode worker reports the prefix it restored from its host tier as
host hits in ``cached_tokens_details`` (upstream's flags: the decode radix
cache and HiCache; no series flag).

0.5.23's ``prepare_for_prebuilt`` credits all of the decode-side reuse to
device hits, so a prefix the worker loaded back from host memory reads
``{"device": N, "host": 0}`` in the response, the OpenAI usage details and
``sglang:cached_tokens_total``. Real ``UnifiedRadixCache`` and decode queues
on CPU (``harness.stacks.decode_hicache_stack``): a 256-token prefix, its
first ``device`` tokens on the device and the rest only in host memory, is
admitted, restored, committed by ``_commit_transfer_to_req`` from the
metadata slot prefill filled (``prefill`` cached tokens), and enters the
running batch through ``prepare_for_prebuilt``; the details are what the
output streamer sends. Both tree cores; a prefix held on the device alone is
the control.
"""

import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.decode_hicache_scenarios import restored_prefix_cached_tokens

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_device_only_prefix_counts_as_device": "no host restore: upstream counts it right"
}

PREFIX = 256


class TestRestoredPrefixCachedTokens(unittest.TestCase):
    tree_core = "python"

    def run_split(self, device, prefill=0):
        host = PREFIX - device
        (r,) = run_ranks(
            restored_prefix_cached_tokens,
            1,
            device_tokens=device,
            host_tokens=host,
            prefill_cached=prefill,
            tree_core=self.tree_core,
        )
        print(self.tree_core, device, prefill, r)
        self.assertEqual(r["evicted_device"], host)  # host-only from here
        self.assertEqual((r["l1"], r["l2"], r["promised"]), (device, host, PREFIX))
        self.assertEqual(r["status"], "ready")
        self.assertEqual(r["prefix_len"], PREFIX)
        self.assertEqual(r["cached_tokens"], PREFIX)
        return r["details"]

    def test_restored_span_counts_as_host(self):
        # 0.5.23: {"device": 256, "host": 0}
        self.assertEqual(self.run_split(128), {"device": 128, "host": 128})

    def test_prefix_restored_entirely_from_host(self):
        self.assertEqual(self.run_split(0), {"device": 0, "host": 256})

    def test_prefill_reported_hits_stay_as_prefill_reported_them(self):
        # Prefill computed nothing of [0, 192): its device hits. The decode
        # worker's reuse beyond that, [192, 256), came from its host tier.
        self.assertEqual(self.run_split(128, prefill=192), {"device": 192, "host": 64})

    def test_the_l3_part_of_a_restore_counts_as_storage(self):
        # fixes/0008's storage part: device [0, 64), host [64, 128), then
        # [128, 384) only in L3 (file backend; 256 tokens, the default
        # prefetch threshold): prefetched to host and restored with the
        # rest. 0.5.23: {"device": 384, "host": 0, "storage": 0}
        with tempfile.TemporaryDirectory(prefix="decode-l3-") as storage_dir:
            (r,) = run_ranks(
                restored_prefix_cached_tokens,
                1,
                device_tokens=64,
                host_tokens=64,
                storage_tokens=256,
                storage_dir=storage_dir,
                tree_core=self.tree_core,
            )
        print(self.tree_core, "l3", r)
        self.assertEqual((r["evicted_device"], r["evicted_host"]), (320, 256))
        self.assertEqual((r["l1"], r["l2"], r["l3"]), (64, 64, 256), r)
        self.assertEqual((r["status"], r["cached_tokens"]), ("ready", 384), r)
        self.assertEqual(
            r["details"],
            {"device": 64, "host": 64, "storage": 256, "storage_backend": "file"},
        )

    def test_device_only_prefix_counts_as_device(self):
        self.assertEqual(self.run_split(PREFIX), {"device": 256, "host": 0})


class TestRestoredPrefixCachedTokensRust(TestRestoredPrefixCachedTokens):
    tree_core = "rust"


if __name__ == "__main__":
    unittest.main()
