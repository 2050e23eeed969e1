"""A decode worker with HiCache promises prefill no host span that its tree
will not load back.

``UnifiedRadixCache.init_load_back`` skips a host span shorter than the
tree's ``load_back_threshold`` (10 tokens). 0.5.23's decode admission promises
prefill every matched token, the host-only ones included, so a request whose
match is 1-9 host-only tokens fails its restore and the request is aborted (on
a live PD server: "HiCache load_back failed ... expected decode_prefix_len=1
(l1=0, l2=1, l3=0)", the client gets an error). Real ``UnifiedRadixCache``
and decode queues on CPU (``harness.stacks.decode_hicache_stack``), page size 4,
both tree cores; the span at the threshold is the control that is still restored.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.decode_hicache_scenarios import short_host_span

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_span_at_the_threshold_is_promised_and_restored_exactly": "at the threshold upstream loads it back too"
}

PAGE = 4
SHORT = 8  # two pages, under the threshold
AT_THRESHOLD = 12  # three pages: the first page-aligned span >= 10


class TestShortHostSpan(unittest.TestCase):
    tree_core = "python"

    def run_span(self, tokens):
        (r,) = run_ranks(
            short_host_span,
            1,
            host_tokens=tokens,
            page_size=PAGE,
            tree_core=self.tree_core,
        )
        print(self.tree_core, tokens, r)
        self.assertEqual(r["evicted_device"], tokens)  # host-only from here
        self.assertEqual(r["admitted"], ["r0"])
        return r

    def test_span_below_the_threshold_is_not_promised_and_restores(self):
        r = self.run_span(SHORT)
        self.assertLess(SHORT, r["threshold"])
        self.assertEqual(r["promised"], 0)  # prefill computes the 8 tokens
        self.assertEqual(r["status"], "ready")
        self.assertIsNone(r.get("restored_bytes_equal"))  # nothing to restore

    def test_span_at_the_threshold_is_promised_and_restored_exactly(self):
        r = self.run_span(AT_THRESHOLD)
        self.assertGreaterEqual(AT_THRESHOLD, r["threshold"])
        self.assertEqual(r["promised"], AT_THRESHOLD)
        self.assertEqual(r["status"], "ready")
        self.assertIs(r["restored_bytes_equal"], True)


class TestShortHostSpanRust(TestShortHostSpan):
    tree_core = "rust"


if __name__ == "__main__":
    unittest.main()
