"""Sampling and request fields are range-checked before the scheduler.

A property-based fuzz (hypothesis) draws generate requests: sampling params
with integers at the int32/int64 edges, the vocabulary and the context,
None, negative and huge values, NaN and infinite floats, logit-bias keys that
are not token ids, lists of odd lengths, invalid stop regexes; single prompts,
batches and n > 1. Each goes through the tokenizer manager's real admission
path (``harness.stacks.request_admission_stack``: normalization, validation,
``SamplingParams`` normalize and verify). The property: the request is
refused with a ``ValueError`` (HTTP 400) that names one of the fields drawn,
or every tensor the scheduler builds from it (``SamplingBatchInfo``, the
penalizers, one torch sampling step, the logprob gathers) is built without an
exception, the sampler gets a finite distribution, and the request asks for
no min_new_tokens the context cannot hold. Pristine 0.5.23 fails it: top_k
past int32 raises in ``SamplingBatchInfo.from_schedule_batch``. A refusal
passes that property whenever it names a field, so a second one draws only
requests whose every field is in range (edges first): each must be served
(a valid request refused fails it).

The example tests pin the known cases and the boundaries that stay accepted.
"""

import math
import unittest

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sglang.test.ci.ci_register import register_cpu_ci

from harness.stacks.request_admission_stack import Admission

register_cpu_ci(est_time=40, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")

VOCAB, CONTEXT = 100, 512
TOP_K_ALL = 1 << 30
MAX_N = 1024  # sampling/field_ranges.py
PROMPT = [5, 6, 7]

# What counts as naming a field in upstream's own messages.
NAMES = {
    "max_new_tokens": ("max_new_tokens", "maximum context length"),
    "n": ("n must", "parallel_sample_num"),
    "rid": ("rid", "request IDs"),
    "input_ids": ("input_ids", "prompt is empty"),
    "text": ("prompt is empty",),
}

EDGE_INTS = [
    -(2**64),
    -(2**63),
    -(2**31) - 1,
    -(2**31),
    -2,
    -1,
    0,
    1,
    2,
    VOCAB - 1,
    VOCAB,
    VOCAB + 1,
    CONTEXT - len(PROMPT),
    CONTEXT - len(PROMPT) + 1,
    CONTEXT,
    TOP_K_ALL,
    TOP_K_ALL + 1,
    2**31 - 1,
    2**31,
    2**32,
    2**40,
    2**63 - 1,
    2**63,
    2**64,
]
ints = st.one_of(
    st.integers(0, 8), st.sampled_from(EDGE_INTS), st.integers(-(2**65), 2**65)
)
maybe_int = st.one_of(st.none(), ints)
floats = st.one_of(
    st.floats(0.0, 1.0),
    st.sampled_from([0.0, 1e-7, 0.5, 1.0, 2.0, 2.5, 1e39, -1e39, 3.4e38]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-5, 5),
)
maybe_float = st.one_of(st.none(), floats)
token_ids = st.lists(ints, max_size=3)
bias_keys = st.one_of(ints.map(str), st.sampled_from(["x", "", "1.5", " 3", "0x10"]))
regexes = st.one_of(
    st.sampled_from(["(", "[a", "a{2,1}", "(?<=a+)b", "*", "\\", "a|b", "x+$"]),
    st.text(max_size=6),
)
# n: no large valid values (each sample costs the tokenizer manager work).
n_values = st.sampled_from([None, -(2**63), -1, 0, 1, 2, 3, MAX_N + 1, 2**40])

SAMPLING_FIELDS = {
    "max_new_tokens": maybe_int,
    "min_new_tokens": maybe_int,
    "top_k": maybe_int,
    "temperature": maybe_float,
    "top_p": maybe_float,
    "min_p": maybe_float,
    "frequency_penalty": maybe_float,
    "presence_penalty": maybe_float,
    "repetition_penalty": maybe_float,
    "n": n_values,
    "stop_token_ids": token_ids,
    "logit_bias": st.dictionaries(bias_keys, floats, max_size=2),
    "sampling_seed": maybe_int,
    "stop_regex": st.one_of(regexes, st.lists(regexes, max_size=2)),
    "stream_interval": maybe_int,
}
REQUEST_FIELDS = {
    "rid": st.sampled_from([None, "r1", ["a"], ["a", "b"], []]),
    "return_logprob": st.booleans(),
    "top_logprobs_num": maybe_int,
    "logprob_start_len": maybe_int,
    "token_ids_logprob": token_ids,
}


def some_of(draw, fields, most):
    """A few fields at a time, so that one bad value does not hide another."""
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=most, unique=True))
    return {name: draw(fields[name]) for name in names}


@st.composite
def requests(draw):
    batch = draw(st.sampled_from([None, 1, 2]))  # None: a single prompt
    body = {}
    prompt = draw(st.sampled_from(["input_ids", "text", "both"]))
    if prompt != "text":
        body["input_ids"] = PROMPT if batch is None else [PROMPT] * batch
    if prompt != "input_ids":
        body["text"] = "page layer" if batch is None else ["page layer"] * batch
    if prompt == "both":  # input_ids of any nesting beside the text
        body["input_ids"] = draw(
            st.sampled_from([PROMPT, [PROMPT], [[]], [PROMPT] * 2, [PROMPT] * 3])
        )
    params = {"max_new_tokens": 4, **some_of(draw, SAMPLING_FIELDS, 3)}
    if draw(st.sampled_from(["dict", "dict", "dict", "list"])) == "list":
        body["sampling_params"] = [params] * draw(st.integers(0, 3))
    else:
        body["sampling_params"] = params
    body.update(some_of(draw, REQUEST_FIELDS, 2))
    return body


# Every field drawn inside the range its check and upstream's verify accept
# (sampling_params.py, field_ranges.py), edges first: a refusal of any of
# these is a bug.
valid_ids = st.one_of(st.sampled_from([0, VOCAB - 1]), st.integers(0, VOCAB - 1))
VALID_SAMPLING_FIELDS = {
    "top_k": st.one_of(
        st.just(-1),
        st.integers(1, VOCAB + 1),
        st.sampled_from([TOP_K_ALL, TOP_K_ALL + 1, 2**31, 2**63]),
    ),
    "temperature": st.one_of(st.just(0.0), st.floats(1e-3, 2.0)),
    "top_p": st.floats(1e-3, 1.0),
    "min_p": st.floats(0.0, 1.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(1e-3, 2.0),
    "stop_token_ids": st.lists(valid_ids, max_size=3),
    "logit_bias": st.dictionaries(
        valid_ids.map(str),
        st.one_of(st.just(-math.inf), st.floats(-100.0, 100.0)),
        max_size=3,
    ),
    "sampling_seed": st.integers(-(2**63), 2**63 - 1),
    "stop_regex": st.one_of(
        st.sampled_from(["a|b", "x+$", "page", r"\d{2}"]),
        st.lists(st.sampled_from(["a|b", "layer"]), max_size=2),
    ),
    "stream_interval": st.integers(1, 8),
}


@st.composite
def valid_requests(draw):
    """A request every field of which is in range: it must be served."""
    batch = draw(st.sampled_from([None, 1, 2]))
    n = draw(st.sampled_from([None, 1, 2]))
    body = {}
    if draw(st.booleans()):
        body["input_ids"] = PROMPT if batch is None else [PROMPT] * batch
    else:
        body["text"] = "page layer" if batch is None else ["page layer"] * batch
    max_new = draw(st.integers(1, 16))
    params = {
        "max_new_tokens": max_new,
        "min_new_tokens": draw(st.integers(0, max_new)),
        "n": n,
        **some_of(draw, VALID_SAMPLING_FIELDS, 4),
    }
    if batch is not None and draw(st.booleans()):
        body["sampling_params"] = [params] * batch
    else:
        body["sampling_params"] = params
    if draw(st.booleans()):
        body["return_logprob"] = True
        body["top_logprobs_num"] = draw(
            st.sampled_from([0, VOCAB]) | st.integers(0, VOCAB)
        )
        body["logprob_start_len"] = draw(st.sampled_from([-1, 0, 1, 2]))
        ids = st.lists(valid_ids, min_size=1, max_size=3)
        body["token_ids_logprob"] = draw(st.one_of(st.none(), ids))
    return body


def fields_of(body):
    out = set(body)
    params = body.get("sampling_params")
    for entry in params if isinstance(params, list) else [params]:
        out |= set(entry or {})
    if isinstance(params, list) or "rid" in body:
        out |= {"sampling_params", "rid"}
    return out


def names_a_field(message, fields):
    return any(
        name in message for field in fields for name in NAMES.get(field, (field,))
    )


class AdmissionCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.adm = Admission(vocab=VOCAB, context_len=CONTEXT)

    def admit(self, body):
        """The tokenizer manager's answer: ValueError (HTTP 400) or the
        tokenized requests; any other exception is an HTTP 500."""
        try:
            return self.adm.admit(body)
        except ValueError:
            raise
        except Exception as e:
            self.fail(f"HTTP 500: {type(e).__name__}: {e} for {body}")

    def schedule(self, tokenized):
        """The scheduler's sampling step; an exception here kills it."""
        try:
            return self.adm.schedule(tokenized)
        except Exception as e:
            self.fail(f"the scheduler raised {type(e).__name__}: {e}")

    def refused(self, body, *phrases):
        with self.assertRaises(ValueError) as ctx:
            self.admit(body)
        for phrase in phrases:
            self.assertIn(phrase, str(ctx.exception))
        return str(ctx.exception)

    def served(self, body):
        tokenized = self.admit(body)
        ids = self.schedule(tokenized)
        self.assertTrue(all(0 <= i < VOCAB for i in ids), ids)
        return tokenized


# Both properties: seeded, no example database, no deadline.
SEEDED = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def one(**params):
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **params}}


class TestSamplingFieldRangesProperty(AdmissionCase):
    @settings(SEEDED, max_examples=300)
    @given(body=requests())
    # The known killers and 500s, always run before the drawn requests.
    @example(body=one(top_k=10**10, temperature=1.0))
    @example(body=one(min_new_tokens=2**40, max_new_tokens=None))
    @example(body=one(logit_bias={"5": math.nan}, temperature=1.0))
    @example(body=one(stop_regex="("))
    @example(body={**one(), "rid": ["a", "b"]})
    @example(body={"input_ids": PROMPT, "sampling_params": [{}, {}]})
    @example(body={"text": "page", "input_ids": [[]], "sampling_params": {}})
    def test_refused_naming_a_field_or_the_scheduler_builds_it(self, body):
        try:
            tokenized = self.admit(body)
        except ValueError as e:
            self.assertTrue(names_a_field(str(e), fields_of(body)), (str(e), body))
            return
        for t in tokenized:
            room = CONTEXT - len(t.input_ids)
            self.assertLessEqual(t.sampling_params.min_new_tokens, room, body)
        self.schedule(tokenized)


class TestValidRequestsServed(AdmissionCase):
    @settings(SEEDED, max_examples=150)
    @given(body=valid_requests())
    # The boundaries that stay accepted, always run before the drawn ones.
    @example(body=one(top_k=TOP_K_ALL + 1, temperature=1.0))
    @example(body=one(logit_bias={"0": -math.inf, str(VOCAB - 1): 100.0}))
    @example(body=one(stop_token_ids=[0, VOCAB - 1]))
    @example(body={**one(), "return_logprob": True, "top_logprobs_num": VOCAB})
    @example(body={"input_ids": [PROMPT] * 2, "sampling_params": {"n": MAX_N}})
    def test_a_valid_request_is_served(self, body):
        # The refusal property above passes on any refusal that names a
        # field; this one fails on a refusal of a request in range.
        try:
            tokenized = self.adm.admit(body)
        except ValueError as e:
            self.fail(f"a valid request was refused: {e} for {body}")
        except Exception as e:
            self.fail(f"HTTP 500: {type(e).__name__}: {e} for {body}")
        ids = self.schedule(tokenized)
        self.assertTrue(all(0 <= i < VOCAB for i in ids), (ids, body))


class TestSamplingFieldRanges(AdmissionCase):
    def test_top_k_past_int32_means_the_whole_vocabulary(self):
        # 0.5.23: RuntimeError "value cannot be converted to type int32
        # without overflow" in SamplingBatchInfo.from_schedule_batch.
        for top_k in (TOP_K_ALL + 1, 2**31, 10**10, 2**64):
            with self.subTest(top_k=top_k):
                (t,) = self.served(one(top_k=top_k, temperature=1.0))
                self.assertEqual(t.sampling_params.top_k, TOP_K_ALL)
        for top_k in (1, VOCAB, VOCAB + 1, TOP_K_ALL):
            with self.subTest(top_k=top_k):
                (t,) = self.served(one(top_k=top_k, temperature=1.0))
                self.assertEqual(t.sampling_params.top_k, top_k)
        (t,) = self.served(one(top_k=-1, temperature=1.0))
        self.assertEqual(t.sampling_params.top_k, TOP_K_ALL)
        for top_k in (0, -2, -(2**40)):
            with self.subTest(top_k=top_k):
                self.refused(one(top_k=top_k, temperature=1.0), "top_k", "-1")

    def test_min_new_tokens_the_context_cannot_hold(self):
        room = CONTEXT - len(PROMPT)
        for max_new in (None, 2**40):
            with self.subTest(max_new_tokens=max_new):
                message = self.refused(
                    one(min_new_tokens=2**40, max_new_tokens=max_new)
                )
                self.assertTrue("min_new_tokens" in message or max_new, message)
        message = self.refused(
            one(min_new_tokens=room + 1, max_new_tokens=None),
            "min_new_tokens",
            f"[0, {room}]",
        )
        (t,) = self.adm.admit(one(min_new_tokens=room, max_new_tokens=None))
        self.assertEqual(t.sampling_params.min_new_tokens, room)
        self.adm.schedule([t])

    def test_min_new_tokens_is_clipped_under_auto_truncate(self):
        room = CONTEXT - len(PROMPT)
        self.adm.manager.allow_auto_truncate = True
        try:
            (t,) = self.adm.admit(one(min_new_tokens=2**40, max_new_tokens=None))
        finally:
            self.adm.manager.allow_auto_truncate = False
        self.assertEqual(t.sampling_params.min_new_tokens, room)
        self.adm.schedule([t])

    def test_logit_bias(self):
        for value in (math.nan, math.inf, 1e39, -1e39):
            with self.subTest(value=value):
                self.refused(one(logit_bias={"5": value}), "logit_bias", "float32")
        for key in ("x", "1.5", str(VOCAB), "-1"):
            with self.subTest(key=key):
                self.refused(
                    one(logit_bias={key: 1.0}), "logit_bias", f"[0, {VOCAB - 1}]"
                )
        self.served(one(logit_bias={"5": -math.inf, "6": 3.4e38}, temperature=1.0))
        self.served(one(logit_bias={"0": -100, str(VOCAB - 1): 100}))

    def test_n(self):
        for n in (0, -1, MAX_N + 1, 2**40):
            with self.subTest(n=n):
                body = {"input_ids": [PROMPT, PROMPT], "sampling_params": {"n": n}}
                self.refused(body, f"n must be in [1, {MAX_N}]")
        for n in (None, 1, 3, MAX_N):
            with self.subTest(n=n):
                self.served(
                    {"input_ids": [PROMPT, PROMPT], "sampling_params": {"n": n}}
                )

    def test_top_logprobs_num_negative(self):
        body = {
            "input_ids": [PROMPT, PROMPT],
            "return_logprob": True,
            "top_logprobs_num": [-3, 2],
        }
        self.refused(body, "top_logprobs_num", f"[0, {VOCAB}]")
        self.served({**body, "top_logprobs_num": [0, 2]})
        # Without return_logprob the count is not used.
        self.served({**body, "return_logprob": False})


if __name__ == "__main__":
    unittest.main()
