"""A PD decode request that even the empty decode pool cannot admit is aborted
with a clear error, and prefill is told (upstream's flags; no series flag).

Decode admission charges ``--num-reserved-decode-tokens`` (default 512) on top
of a request's page-aligned KV. 0.5.23 refuses only a prompt longer than the
pool, so a prompt within 512 tokens of the pool size enters the prealloc queue
and is never admitted: ``pop_preallocated`` stops at it every round, the client
waits forever with no error, and every request queued behind it waits too.
Real ``UnifiedRadixCache`` and decode queues on CPU
(``harness.stacks.decode_hicache_stack``): a 1024-token pool of 16-token pages,
the queue head a ``prompt`` request, then a 64-token one; three admission
rounds. The largest prompt that fits is the control that is still admitted.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.decode_hicache_scenarios import never_fitting_request

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_largest_prompt_that_fits_is_admitted": "the boundary: upstream admits it too"
}

POOL = 1024
PAGE = 16
RESERVED = 512  # upstream's --num-reserved-decode-tokens default
LARGEST_FIT = (POOL - RESERVED) // PAGE * PAGE  # 512: 512 + 512 fills the pool


def need(prompt: int) -> int:
    return -(-prompt // PAGE) * PAGE + RESERVED


class TestNeverFittingRequest(unittest.TestCase):
    tree_core = "python"

    def run_head(self, prompt):
        (r,) = run_ranks(
            never_fitting_request,
            1,
            prompt_tokens=prompt,
            reserved=RESERVED,
            tree_core=self.tree_core,
        )
        print(self.tree_core, prompt, r)
        self.assertEqual((r["pool"], r["page_size"]), (POOL, PAGE))
        self.assertEqual(r["host_lock_refs"], 0)
        return r

    def assert_aborted_and_queue_moves(self, prompt):
        self.assertGreater(need(prompt), POOL)
        r = self.run_head(prompt)
        # 0.5.23: [[], [], []] -- the head never leaves the queue, nor does
        # the request behind it.
        self.assertEqual(r["failed"], [["head"], [], []])
        self.assertEqual(r["admitted"], [["small"], [], []])
        self.assertEqual(r["queued"], [])
        reason = r["finished_reason"]
        self.assertEqual(reason["type"], "abort")
        self.assertEqual(int(reason["status_code"]), 400)
        for part in (
            f"its {prompt} tokens of KV",
            f"need {need(prompt)}",
            f"decode KV pool's {POOL} (--max-total-tokens)",
            f"{RESERVED} reserved decode tokens (--num-reserved-decode-tokens)",
            f"Send at most {LARGEST_FIT} tokens",
        ):
            self.assertIn(part, reason["message"])
        self.assertEqual(r["streamed"], ["head"])  # the client gets it, once
        self.assertTrue(r["receiver_aborted"])  # prefill is told
        self.assertTrue(r["receiver_cleared"])
        # The head took nothing: only the 64-token request holds KV, a
        # request slot and a metadata slot.
        self.assertFalse(r["head_holds_kv"])
        start, after = r["start"], r["after"]
        self.assertEqual(after["device_available"], start["device_available"] - 64)
        self.assertEqual(after["req_slots"], start["req_slots"] - 1)
        self.assertEqual(after["metadata_slots"], start["metadata_slots"] - 1)

    def test_prompt_far_over_the_budget_is_aborted(self):
        # Within 512 tokens of the pool: passes 0.5.23's own length checks.
        self.assert_aborted_and_queue_moves(600)

    def test_prompt_one_page_over_the_budget_is_aborted(self):
        self.assert_aborted_and_queue_moves(LARGEST_FIT + 1)

    def test_largest_prompt_that_fits_is_admitted(self):
        self.assertEqual(need(LARGEST_FIT), POOL)
        r = self.run_head(LARGEST_FIT)
        self.assertIsNone(r["finished_reason"])
        self.assertFalse(r["receiver_aborted"])
        self.assertEqual(r["admitted"][0], ["head"])
        self.assertEqual(r["failed"], [[], [], []])
        # Its KV and its reservation fill the pool: the next request waits.
        self.assertEqual(r["queued"], ["small"])
        self.assertEqual(r["after"]["device_available"], POOL - LARGEST_FIT)


class TestNeverFittingRequestRust(TestNeverFittingRequest):
    tree_core = "rust"


if __name__ == "__main__":
    unittest.main()
