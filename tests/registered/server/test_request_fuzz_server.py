"""No request takes the server down: a seeded fuzz of the request schema over
HTTP, against our wheel and against pristine upstream 0.5.23.

Our server (every feature off) gets every named malformed request of
``harness.request_fuzz`` (``/generate``, ``/v1/completions``,
``/v1/chat/completions``) and ``RANDOM_CASES`` seeded mutations, each followed
by a good request that must be served: it answers every one (200 or a 4xx)
and stays up; the requests that crashed upstream answer 400 naming the field,
and so do the ones fixes/0009 and fixes/0010 refuse (``FIXED_400``; a top_k
past int32 is served); every 4xx body has its route's documented error JSON.
Upstream's servers show which requests kill 0.5.23 (``UPSTREAM_DIES_ON``, one
per crash site, each the last request of a server: the process tree exits,
told apart from a hang) and that the other named requests do not. On a model
whose tokenizer adds BOS (``tiny-llama-bos``) an empty text is a one-token
prompt: both trees serve it.

The servers are ``harness.shared_servers``': the plain pristine and patched
ones are the drop-in test's too when both files run in one session.
"""

import json
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness import shared_servers
from harness.request_fuzz import (
    DEATH_WAIT_S,
    GREEDY,
    OPENAI_ROUTES,
    error_shape,
    named_cases,
    random_cases,
    run_cases,
)

register_cpu_ci(est_time=240, suite="base-b-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PROJECT_ONLY = "runs this project's CPU server and pristine upstream's"

VOCAB = 2048  # scripts/tiny_model.py
RANDOM_SEED, RANDOM_CASES = 23, 48

# Each request below killed a pristine 0.5.23 server (scheduler died, the
# launcher stopped every process); the value is the field our 400 names.
UPSTREAM_DIES_ON = {
    "prompt_id_past_vocab": "input_ids",  # IndexError in embed_tokens
    "text_empty": "prompt is empty",  # reshape of 0 elements in the rotary
    "stop_id_past_vocab": "stop_token_ids",  # min_new_tokens masks the logits
    "top_logprobs_num_past_vocab": "top_logprobs_num",  # top-k past the vocab
    "logprob_start_len_below_minus_one": "logprob_start_len",  # assertion
}
# The same crash sites reached another way (upstream dies on these too; not
# run there, each would cost one more server).
SAME_SITE = {
    "prompt_id_at_vocab": "prompt_id_past_vocab",
    "prompt_id_negative": "prompt_id_past_vocab",
    "batch_ids_with_oov": "prompt_id_past_vocab",
    "completions_prompt_id_past_vocab": "prompt_id_past_vocab",
    "completions_prompt_id_negative": "prompt_id_past_vocab",
    "batch_text_with_empty": "text_empty",
    "batch_ids_with_empty": "text_empty",
    "stop_id_negative": "stop_id_past_vocab",
    "completions_stop_id_past_vocab": "stop_id_past_vocab",
    "chat_stop_id_past_vocab": "stop_id_past_vocab",
    "top_logprobs_num_past_vocab_stream": "top_logprobs_num_past_vocab",
    "completions_logprobs_past_vocab": "top_logprobs_num_past_vocab",
    "chat_top_logprobs_past_vocab": "top_logprobs_num_past_vocab",
}
# Requests fixes/0009 and fixes/0010 answer 400 (the value: the field the
# answer names). Not sent to upstream (one more server each for the killers,
# a minute of generation for min_new_tokens): the unit PR tests
# test_sampling_field_ranges.py and test_request_shape.py show each failing
# on pristine 0.5.23 (top_k: the int32 overflow that kills the scheduler; the
# shapes and stop_regex: a non-ValueError, HTTP 500).
FIXED_400 = {
    "min_new_tokens_past_context": "min_new_tokens",
    "logit_bias_past_float32": "logit_bias",
    "logit_bias_key_not_an_id": "logit_bias",
    "n_zero": "n must be in [1, 1024]",
    "top_logprobs_num_negative": "top_logprobs_num",
    "stop_regex_invalid": "stop_regex",
    "stop_regex_uncompilable": "stop_regex",
    "text_with_nested_input_ids": "input_ids",
    "rid_list_single_prompt": "rid",
    "sampling_params_list_single_prompt": "sampling_params",
    "sampling_params_list_short": "sampling_params",
    "completions_stop_regex_invalid": "stop_regex",
    "completions_logit_bias_past_float32": "logit_bias",
    "completions_n_zero": "n must be in [1, 1024]",
    "chat_stop_regex_invalid": "stop_regex",
}
# Served: a top_k past int32 samples from the whole vocabulary (clamped to
# TOP_K_ALL, upstream's value for -1), and n null means 1.
FIXED_200 = {
    "top_k_past_int32",
    "completions_top_k_past_int32",
    "chat_top_k_past_int32",
    "n_null",
}
# Served by upstream, 400 naming the field by ours: fixes/0001 checks every
# stop id against the vocabulary, as upstream checks logit_bias keys (0.5.23
# only crashes when min_new_tokens masks the stop ids).
UPSTREAM_200 = {"stop_id_past_vocab_without_min_new_tokens": "stop_token_ids"}
# Answered 500 by upstream (IndexError on an empty sampling_params list, the
# server stays up), 400 naming the field by ours.
UPSTREAM_500 = {"sampling_params_list": "sampling_params"}


# Named requests sent on the servers of the BOS model (tiny-llama-bos): its
# tokenizer adds <s>, so an empty text is a prompt of one token.
BOS_CASES = {
    "text_empty_bos": ("/generate", {"text": "", "sampling_params": GREEDY}),
    "completions_prompt_empty_bos": (
        "/v1/completions",
        {"model": "m", "prompt": "", "max_tokens": 2},
    ),
}


def _crashers():
    return set(UPSTREAM_DIES_ON) | set(SAME_SITE)


def _not_on_upstream():
    return _crashers() | set(FIXED_400) | FIXED_200


def _named():
    return named_cases(VOCAB)


def _survivable():
    return {k: v for k, v in _named().items() if k not in _not_on_upstream()}


def _fuzz(cases):
    def run(server):
        return run_cases(server.base_url, cases, tree_pids=server.pids)

    return run


# Our wheel: the named cases on the plain server the drop-in test shares, the
# seeded mutations beside them on the BOS model's (two servers halve the
# chain of requests); pristine upstream: the named cases it survives on the
# shared plain server, the BOS cases on the BOS model's, and each crash site
# as the last request of a server: those two, then one server each.
OURS = shared_servers.work("patched", name="fuzz-named", fn=_fuzz(_named()))
OURS_BOS = shared_servers.work(
    "patched",
    model="tiny-llama-bos",
    name="fuzz-bos",
    fn=_fuzz({**BOS_CASES, **random_cases(RANDOM_SEED, RANDOM_CASES, VOCAB)}),
)
UPSTREAM = shared_servers.work("upstream", name="fuzz-named", fn=_fuzz(_survivable()))
UPSTREAM_BOS = shared_servers.work(
    "upstream", model="tiny-llama-bos", name="fuzz-bos", fn=_fuzz(BOS_CASES)
)
KILLER_SERVERS = {
    "prompt_id_past_vocab": UPSTREAM,
    "stop_id_past_vocab": UPSTREAM_BOS,  # the crash does not depend on BOS
}
for _name in UPSTREAM_DIES_ON:
    _k = KILLER_SERVERS.get(_name)
    shared_servers.work(
        _k[0] if _k else "upstream",
        model=_k[2] if _k else "tiny-llama",
        instance=_k[3] if _k else _name,
        name=f"dies-{_name}",
        fn=_fuzz({_name: _named()[_name]}),
        ends_server=True,
    )
    KILLER_SERVERS.setdefault(_name, shared_servers.key("upstream", instance=_name))


class TestRequestFuzzServer(unittest.TestCase):
    ours: list = []
    upstream_survived: list = []
    upstream_bos: list = []
    upstream_deaths: dict = {}

    @classmethod
    def setUpClass(cls):
        named = shared_servers.result(OURS, "fuzz-named")
        bos_and_random = shared_servers.result(OURS_BOS, "fuzz-bos")
        cls.ours = named + bos_and_random[len(BOS_CASES) :]
        cls.ours_bos = bos_and_random[: len(BOS_CASES)]
        cls.upstream_survived = shared_servers.result(UPSTREAM, "fuzz-named")
        cls.upstream_bos = shared_servers.result(UPSTREAM_BOS, "fuzz-bos")
        cls.upstream_deaths = {
            name: shared_servers.result(k, f"dies-{name}")
            for name, k in KILLER_SERVERS.items()
        }

    def test_our_server_answers_every_case_and_stays_up(self):
        expected = len(named_cases(VOCAB)) + RANDOM_CASES
        self.assertEqual(len(self.ours), expected, self.ours[-1])
        for r in self.ours:
            self.assertTrue(r["alive"], r)
            self.assertIsNotNone(r["status"], r)
            if r["name"].startswith("random"):
                self.assertIn(r["status"] // 100, (2, 4), r)
            else:
                self.assertTrue(r["status"] == 200 or 400 <= r["status"] < 500, r)
        # The fuzz reaches both outcomes.
        statuses = {r["status"] for r in self.ours}
        self.assertIn(200, statuses)
        self.assertIn(400, statuses)

    def test_what_crashed_upstream_answers_400_naming_the_field(self):
        ours = {r["name"]: r for r in self.ours}
        for name in _crashers():
            site = SAME_SITE.get(name, name)
            field = UPSTREAM_DIES_ON[site]
            r = ours[name]
            with self.subTest(name=name):
                self.assertIn(field, r["body"], r)
                if "stream" in name:  # the stream's error event (200 + SSE)
                    self.assertEqual(r["status"], 200, r)
                    self.assertIn('"code":400', r["body"], r)
                else:
                    self.assertEqual(r["status"], 400, r)
        # No server path or stack frame in any answer.
        for r in self.ours:
            self.assertNotIn("site-packages", r["body"], r["name"])
            self.assertNotIn('File "', r["body"], r["name"])

    def test_fixed_requests_answer_400_naming_the_field_at_once(self):
        ours = {r["name"]: r for r in self.ours}
        for name, field in {**FIXED_400, **UPSTREAM_500}.items():
            r = ours[name]
            with self.subTest(name=name):
                self.assertEqual(r["status"], 400, r)
                self.assertIn(field, r["body"], r)
        for name in FIXED_200:
            with self.subTest(name=name):
                self.assertEqual(ours[name]["status"], 200, ours[name])
        # Refused before any generation: 0.5.23 generates toward the context
        # length for it (a minute on this CPU model).
        self.assertLess(ours["min_new_tokens_past_context"]["s"], 10)

    def test_upstream_dies_on_each_crash_site(self):
        self.assertEqual(set(self.upstream_deaths), set(UPSTREAM_DIES_ON))
        for name, records in self.upstream_deaths.items():
            with self.subTest(name=name):
                self.assertEqual([r["name"] for r in records], [name], records)
                self.assertFalse(records[0]["alive"], records)
                # A death, not a hang: the whole process tree exits.
                self.assertEqual(records[0]["outcome"], "died", records)
                self.assertLess(records[0]["exit_s"], DEATH_WAIT_S, records)

    def test_upstream_survives_the_other_named_cases(self):
        named = [n for n in named_cases(VOCAB) if n not in _not_on_upstream()]
        self.assertEqual([r["name"] for r in self.upstream_survived], named)
        self.assertTrue(all(r["alive"] for r in self.upstream_survived))
        # Where upstream answers, we answer the same status, except the 500s
        # the fixes turn into 400s.
        ours = {r["name"]: r["status"] for r in self.ours}
        for r in self.upstream_survived:
            if r["name"] in UPSTREAM_500:
                self.assertEqual(r["status"], 500, r)
            elif r["name"] in UPSTREAM_200:
                self.assertEqual(r["status"], 200, r)
                self.assertEqual(ours[r["name"]], 400, r["name"])
            else:
                self.assertEqual(ours[r["name"]], r["status"], r["name"])

    def test_empty_text_on_a_bos_model_is_served_by_both(self):
        # The tokenizer adds <s>: the prompt is one token, nothing to refuse
        # (fixes/0001 checks the prompt after tokenization). The OpenAI route
        # refuses an empty prompt itself, before tokenizing, on both trees.
        expected = {
            "text_empty_bos": (200, "served"),
            "completions_prompt_empty_bos": (400, "served"),
        }
        for tree, records in (("ours", self.ours_bos), ("upstream", self.upstream_bos)):
            with self.subTest(tree=tree):
                self.assertEqual([r["name"] for r in records], list(BOS_CASES))
                for r in records:
                    got = (r["status"], r["outcome"])
                    self.assertEqual(got, expected[r["name"]], r)
                refused = error_shape("/v1/completions", 400, records[1]["body"])
                self.assertIn("Prompt cannot be empty", refused)
        gen = json.loads(self.ours_bos[0]["body"])
        self.assertEqual(gen["meta_info"]["prompt_tokens"], 1, gen)
        self.assertEqual(len(gen["output_ids"]), GREEDY["max_new_tokens"], gen)

    def _case_paths(self):
        return {
            name: path
            for name, (path, _) in {
                **_named(),
                **BOS_CASES,
                **random_cases(RANDOM_SEED, RANDOM_CASES, VOCAB),
            }.items()
        }

    def test_every_4xx_answer_has_its_routes_error_shape(self):
        paths = self._case_paths()
        named_field = {
            **{n: UPSTREAM_DIES_ON[SAME_SITE.get(n, n)] for n in _crashers()},
            **FIXED_400,
            **UPSTREAM_500,
            **UPSTREAM_200,
        }
        checked = {path: 0 for path in set(paths.values())}
        for r in self.ours + self.ours_bos:
            if not 400 <= (r["status"] or 0) < 500:
                continue
            with self.subTest(name=r["name"]):
                message = error_shape(paths[r["name"]], r["status"], r["body"])
                if r["name"] in named_field:
                    self.assertIn(named_field[r["name"]], message, r)
                checked[paths[r["name"]]] += 1
        # Every route answered some 4xx (the check is not vacuous).
        self.assertTrue(all(checked.values()), checked)
        # The streamed refusal: a 200 whose one event is the error.
        r = next(
            r for r in self.ours if r["name"] == "top_logprobs_num_past_vocab_stream"
        )
        event = json.loads(r["body"].split("data: ", 2)[1].split("\n", 1)[0])
        self.assertEqual(set(event), {"error"}, r)
        self.assertEqual(event["error"]["code"], 400, r)
        self.assertIn("top_logprobs_num", event["error"]["message"], r)


class TestErrorShapeCheck(unittest.TestCase):
    """The error-shape check itself, without a server."""

    def test_error_shape_check_refuses_other_shapes(self):
        # Negative controls of the check above: bodies of the wrong shape.
        native = json.dumps({"error": {"message": "stop_token_ids must be"}})
        flat = json.dumps(
            dict(
                object="error",
                message="m",
                type="BadRequestError",
                param=None,
                code=400,
            )
        )
        error_shape("/generate", 400, native)
        error_shape("/generate", 400, json.dumps({"error": "invalid type: map"}))
        error_shape("/generate", 400, flat)
        error_shape("/v1/completions", 400, flat)
        for path, body in (
            ("/generate", json.dumps({"message": "flat, no envelope"})),
            ("/generate", json.dumps({"error": 5})),
            ("/generate", json.dumps({"error": {"msg": "not message"}})),
            ("/generate", json.dumps({"error": ""})),
            ("/v1/completions", json.dumps({"error": "a string"})),
            ("/generate", json.dumps({"error": {"message": ""}})),
            ("/generate", "Internal Server Error"),
            ("/v1/completions", native),  # the native envelope on OpenAI
            ("/v1/completions", flat.replace('"code": 400', '"code": 500')),
            ("/v1/chat/completions", json.dumps({"detail": "x"})),
        ):
            with self.subTest(path=path, body=body):
                with self.assertRaises(AssertionError):
                    error_shape(path, 400, body)
        self.assertEqual(OPENAI_ROUTES, ("/v1/completions", "/v1/chat/completions"))


if __name__ == "__main__":
    unittest.main()
