"""``harness.greedy_ties``: two greedy outputs agree up to a tie on both
servers, and nothing else passes."""

from __future__ import annotations

import unittest

from harness.greedy_ties import (
    MAX_TIES,
    TIE_LOGPROB,
    assert_same_greedy,
    first_divergence,
    top2_of,
)


def rec(ids, top2):
    return dict(output_ids=ids, top2=top2)


# position 1: 7 and 9 are a tie on both servers, in opposite order
A = rec(
    [5, 7, 3], [[(-0.1, 5), (-3.0, 8)], [(-1.00, 7), (-1.01, 9)], [(-0.2, 3), (-2, 4)]]
)
B = rec(
    [5, 9, 4], [[(-0.1, 5), (-3.0, 8)], [(-1.01, 9), (-1.02, 7)], [(-0.3, 4), (-2, 3)]]
)


class TestGreedyTies(unittest.TestCase):
    def test_equal_outputs(self):
        self.assertIsNone(first_divergence(A, A))
        self.assertEqual(assert_same_greedy(self, [A, A], [A, A]), [])

    def test_a_tie_on_both_servers_ends_the_comparison(self):
        self.assertEqual(first_divergence(A, B), ("tie", 1))
        self.assertEqual(assert_same_greedy(self, [A, A], [A, B]), [(1, 1)])

    def test_a_wide_margin_on_either_server_is_a_difference(self):
        wide = [(-1.00, 7), (-1.00 - 2 * TIE_LOGPROB, 9)]
        a = dict(A, top2=[A["top2"][0], wide, A["top2"][2]])
        self.assertEqual(first_divergence(a, B), ("differ", 1))
        self.assertEqual(first_divergence(B, a), ("differ", 1))
        with self.assertRaises(AssertionError):
            assert_same_greedy(self, [a], [B])

    def test_the_margin_is_a_few_bfloat16_steps_of_the_observed_logits(self):
        # CI's ties: one step (0.0039) of a logit in [0.5, 1); 0.03, about
        # eight such steps, is a moved distribution, not a tie
        self.assertLess(TIE_LOGPROB, 0.02)
        for margin, kind in ((0.0039, "tie"), (TIE_LOGPROB, "tie"), (0.03, "differ")):
            a = dict(
                A, top2=[A["top2"][0], [(-1.0, 7), (-1.0 - margin, 9)], A["top2"][2]]
            )
            with self.subTest(margin=margin):
                self.assertEqual(first_divergence(a, B), (kind, 1))

    def test_more_than_a_few_ties_in_one_comparison_fail(self):
        self.assertEqual(MAX_TIES, 2)
        self.assertEqual(
            assert_same_greedy(self, [A, A, A], [B, B, A]), [(0, 1), (1, 1)]
        )
        with self.assertRaises(AssertionError) as ctx:
            assert_same_greedy(self, [A, A, A], [B, B, B], "run")
        self.assertIn("3 outputs part at a tie", str(ctx.exception))

    def test_a_runner_up_that_is_not_the_other_token_is_a_difference(self):
        other = [(-1.00, 7), (-1.01, 11)]
        a = dict(A, top2=[A["top2"][0], other, A["top2"][2]])
        self.assertEqual(first_divergence(a, B), ("differ", 1))

    def test_an_exact_tie_listed_in_either_order_is_a_tie(self):
        # Seen in CI: one server's two best are equal and its greedy token
        # (the argmax) is listed second; the other server's first differs
        # from its second by one bfloat16 step of a logit near 1.
        ours = rec([3, 8], [[(-0.1, 3), (-2, 4)], [(-6.95937, 21), (-6.95937, 8)]])
        theirs = rec([3, 21], [[(-0.1, 3), (-2, 4)], [(-6.95547, 21), (-6.95938, 8)]])
        self.assertEqual(first_divergence(ours, theirs), ("tie", 1))
        self.assertEqual(first_divergence(theirs, ours), ("tie", 1))
        # an exact tie on one server is no tie if the other server's margin
        # is wide
        wide = rec([3, 21], [[(-0.1, 3), (-2, 4)], [(-6.7, 21), (-6.95938, 8)]])
        self.assertEqual(first_divergence(ours, wide), ("differ", 1))
        # nor if this server's greedy token is not among its best
        lost = rec([3, 8], [[(-0.1, 3), (-2, 4)], [(-6.95937, 21), (-6.95937, 9)]])
        self.assertEqual(first_divergence(lost, theirs), ("differ", 1))

    def test_the_first_token_and_lengths(self):
        c = rec([6, 7, 3], A["top2"])
        self.assertEqual(first_divergence(A, c), ("differ", 0))
        self.assertEqual(first_divergence(A, rec([5, 7], A["top2"])), ("differ", 2))

    def test_top2_of_reads_the_servers_rows(self):
        meta = {"output_top_logprobs": [[[-0.5, 12, None], [-0.9, 13, None]]]}
        self.assertEqual(top2_of(meta), [[(-0.5, 12), (-0.9, 13)]])


if __name__ == "__main__":
    unittest.main()
