"""Malformed request shapes are refused with a ValueError (HTTP 400), not an
internal exception (HTTP 500), and the shapes upstream serves stay served.

Each request goes through the tokenizer manager's real admission path
(``harness.stacks.request_admission_stack``). On 0.5.23 a single prompt with
a list of sampling params raises AttributeError, an empty list or a list
shorter than the batch IndexError, an rid list for one prompt TypeError
(unhashable), and an invalid stop_regex re.error.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.stacks.request_admission_stack import Admission

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")

PROMPT = [5, 6, 7]
GREEDY = {"max_new_tokens": 2, "temperature": 0}


class TestRequestShape(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.adm = Admission(vocab=100, context_len=512)

    def admit(self, body):
        """ValueError (HTTP 400) or the tokenized requests; any other
        exception is an HTTP 500 with a traceback."""
        try:
            return self.adm.admit(body)
        except ValueError:
            raise
        except Exception as e:
            self.fail(f"HTTP 500: {type(e).__name__}: {e} for {body}")

    def refused(self, body, *phrases):
        try:
            self.admit(body)
        except ValueError as e:
            for phrase in phrases:
                self.assertIn(phrase, str(e))
            return str(e)
        self.fail(f"admitted: {body}")

    def served(self, body, count):
        tokenized = self.admit(body)
        self.assertEqual(len(tokenized), count)
        try:
            self.adm.schedule(tokenized)
        except Exception as e:
            self.fail(f"the scheduler raised {type(e).__name__}: {e}")
        return tokenized

    def test_sampling_params_list_shapes(self):
        self.refused(
            {"input_ids": PROMPT, "sampling_params": [GREEDY, GREEDY]},
            "sampling_params",
            "single prompt",
        )
        self.refused(
            {"input_ids": PROMPT, "sampling_params": [GREEDY]},
            "sampling_params",
            "single prompt",
        )
        self.refused({"text": "page", "sampling_params": []}, "sampling_params")
        for entries in (1, 3):
            with self.subTest(entries=entries):
                self.refused(
                    {"input_ids": [PROMPT] * 2, "sampling_params": [GREEDY] * entries},
                    "sampling_params",
                    f"{entries} entries for a batch of 2",
                )
        # Served shapes: one entry per prompt, one object for a batch, and a
        # list of one for one prompt with n > 1 (a batch of one).
        self.served({"input_ids": [PROMPT] * 2, "sampling_params": [GREEDY] * 2}, 2)
        self.served({"input_ids": [PROMPT] * 2, "sampling_params": GREEDY}, 2)
        self.served({"input_ids": PROMPT, "sampling_params": [{**GREEDY, "n": 2}]}, 1)

    def test_rid_shapes(self):
        for rid in (["a", "b"], ["a"]):
            with self.subTest(rid=rid):
                self.refused(
                    {"input_ids": PROMPT, "rid": rid, "sampling_params": GREEDY},
                    "rid",
                    "single prompt",
                )
        (t,) = self.served(
            {"input_ids": PROMPT, "rid": "r1", "sampling_params": GREEDY}, 1
        )
        self.assertEqual(t.rid, "r1")
        tokenized = self.served(
            {"input_ids": [PROMPT] * 2, "rid": ["a", "b"], "sampling_params": GREEDY},
            2,
        )
        self.assertEqual([t.rid for t in tokenized], ["a", "b"])

    def test_input_ids_nesting(self):
        # Text and input_ids together: upstream tokenizes nothing and takes
        # the ids, so their nesting must match the prompts the text counts.
        for ids in ([[]], [PROMPT]):
            with self.subTest(ids=ids):
                self.refused(
                    {"text": "page", "input_ids": ids, "sampling_params": GREEDY},
                    "input_ids",
                    "single prompt",
                )
        self.refused(
            {"text": ["a", "b"], "input_ids": PROMPT, "sampling_params": GREEDY},
            "input_ids",
            "batch of 2",
        )
        self.refused(
            {"text": "a", "input_ids": PROMPT, "sampling_params": {**GREEDY, "n": 2}},
            "text or input_ids",
        )
        self.served({"text": "a", "input_ids": PROMPT, "sampling_params": GREEDY}, 1)
        self.served(
            {"text": ["a", "b"], "input_ids": [PROMPT] * 2, "sampling_params": GREEDY},
            2,
        )
        self.served({"input_ids": PROMPT, "sampling_params": {**GREEDY, "n": 2}}, 1)

    def test_stop_regex_must_compile(self):
        for pattern in ("(", "[a", "a{2,1}", "(?<=a+)b", "*"):
            with self.subTest(pattern=pattern):
                self.refused(
                    {
                        "input_ids": PROMPT,
                        "sampling_params": {**GREEDY, "stop_regex": pattern},
                    },
                    "stop_regex",
                    "not a valid regular expression",
                )
        (t,) = self.served(
            {
                "input_ids": PROMPT,
                "sampling_params": {**GREEDY, "stop_regex": ["a|b", "x+$"]},
            },
            1,
        )
        self.assertEqual(t.sampling_params.stop_regex_strs, ["a|b", "x+$"])


if __name__ == "__main__":
    unittest.main()
