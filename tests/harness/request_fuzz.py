"""A bounded, seeded fuzzer over the request schema of a live server.

``named_cases(vocab)`` are hand-made malformed requests (out-of-vocabulary and
negative token ids in every field that carries one, empty prompts, logprob
arguments past their range, invalid grammars and stop regexes, sampling
fields past the scheduler's tensor widths, list shapes that do not fit the
prompts, wrong types) on ``/generate`` and the OpenAI-compatible routes;
``random_cases(seed, n, vocab)`` mutates one or two fields of a valid request
with values drawn from typed edge pools (wrong types, empty and huge values,
boundaries around the vocabulary).
Values that are valid but cost real work (a large ``n``, thousands of new
tokens) are not drawn: they are load, not malformed input.

``run_cases`` sends each case, then a good request that must be served, and
records what happened (with the case's answer time, ``s``); it stops at the
first case after which the server no longer answers (``alive`` False), so a
caller can restart and go on. Given the server's process tree, it tells a
death (the tree exits within ``DEATH_WAIT_S``) from a hang (the tree is still
running then and the good request is still not served): ``outcome``.

``error_shape(path, status, body)`` checks a 4xx body against the error JSON
its route documents and returns its message.
"""

from __future__ import annotations

import json
import random
import time

import requests

from harness.live_server import wait_gone

GOOD = {
    "text": "page layer",
    "sampling_params": {"temperature": 0, "max_new_tokens": 2},
}
GREEDY = {"temperature": 0, "max_new_tokens": 2}
CHAT = [{"role": "user", "content": "page layer"}]


def named_cases(vocab: int) -> dict[str, tuple[str, dict]]:
    """``{name: (path, body)}``."""
    g = GREEDY
    gen = {
        "prompt_id_past_vocab": {
            "input_ids": [5, vocab + 999, 7],
            "sampling_params": g,
        },
        "prompt_id_at_vocab": {"input_ids": [5, vocab], "sampling_params": g},
        "prompt_id_negative": {"input_ids": [-1, 5], "sampling_params": g},
        "prompt_ids_empty": {"input_ids": [], "sampling_params": g},
        "text_empty": {"text": "", "sampling_params": g},
        "batch_text_with_empty": {"text": ["page layer", ""], "sampling_params": g},
        "batch_ids_with_empty": {"input_ids": [[5, 6], []], "sampling_params": g},
        "batch_ids_with_oov": {"input_ids": [[5, 6], [vocab]], "sampling_params": g},
        "prompt_id_int64_overflow": {"input_ids": [5, 2**63], "sampling_params": g},
        "prompt_id_float": {"input_ids": [5, 1.5], "sampling_params": g},
        "prompt_ids_string": {"input_ids": "abc", "sampling_params": g},
        "stop_id_past_vocab": {
            "text": "page",
            "sampling_params": {
                **g,
                "stop_token_ids": [vocab + 5],
                "min_new_tokens": 1,
            },
        },
        "stop_id_negative": {
            "text": "page",
            "sampling_params": {**g, "stop_token_ids": [-3], "min_new_tokens": 1},
        },
        # Without min_new_tokens nothing masks the stop ids: upstream only
        # compares the sampled token with them.
        "stop_id_past_vocab_without_min_new_tokens": {
            "text": "page",
            "sampling_params": {**g, "stop_token_ids": [vocab + 5]},
        },
        "logit_bias_past_vocab": {
            "text": "page",
            "sampling_params": {**g, "logit_bias": {str(vocab + 5): 1.0}},
        },
        "logit_bias_negative": {
            "text": "page",
            "sampling_params": {**g, "logit_bias": {"-1": 1.0}},
        },
        "token_ids_logprob_past_vocab": {
            "text": "page",
            "sampling_params": g,
            "return_logprob": True,
            "token_ids_logprob": [vocab + 5],
        },
        "top_logprobs_num_past_vocab": {
            "text": "page",
            "sampling_params": g,
            "return_logprob": True,
            "top_logprobs_num": 100000,
        },
        "top_logprobs_num_past_vocab_stream": {
            "text": "page",
            "stream": True,
            "sampling_params": g,
            "return_logprob": True,
            "top_logprobs_num": 100000,
        },
        "logprob_start_len_past_prompt": {
            "text": "page layer cache prefix",
            "sampling_params": g,
            "return_logprob": True,
            "logprob_start_len": 100000,
        },
        "logprob_start_len_below_minus_one": {
            "text": GOOD["text"],  # upstream crashes on a cached prompt
            "sampling_params": g,
            "return_logprob": True,
            "logprob_start_len": -5,
        },
        "regex_invalid": {"text": "page", "sampling_params": {**g, "regex": "("}},
        "json_schema_invalid": {
            "text": "page",
            "sampling_params": {**g, "json_schema": "{bad"},
        },
        "ebnf_invalid": {"text": "page", "sampling_params": {**g, "ebnf": "x ::="}},
        "max_new_tokens_huge": {
            "text": "page",
            "sampling_params": {"max_new_tokens": 10**12},
        },
        "sampling_params_list": {"text": "page", "sampling_params": []},
        "lora_unknown": {"text": "page", "lora_path": "nope", "sampling_params": g},
        # Past the scheduler's tensor widths, and request shapes that used to
        # be answered 500 (fixes/0009, fixes/0010).
        "top_k_past_int32": {
            "text": "page",
            "sampling_params": {"max_new_tokens": 2, "top_k": 10**10},
        },
        "min_new_tokens_past_context": {
            "text": "page",
            "sampling_params": {"max_new_tokens": None, "min_new_tokens": 2**40},
        },
        # JSON has no NaN or inf: past float32 is what reaches the row.
        "logit_bias_past_float32": {
            "text": "page",
            "sampling_params": {"max_new_tokens": 2, "logit_bias": {"5": 1e39}},
        },
        "logit_bias_key_not_an_id": {
            "text": "page",
            "sampling_params": {**g, "logit_bias": {"x": 1.0}},
        },
        "n_zero": {"text": ["page", "layer"], "sampling_params": {**g, "n": 0}},
        "n_null": {"text": "page", "sampling_params": {**g, "n": None}},
        "top_logprobs_num_negative": {
            "text": ["page", "layer"],
            "sampling_params": g,
            "return_logprob": True,
            "top_logprobs_num": [-3, 2],
        },
        "stop_regex_invalid": {
            "text": "page",
            "sampling_params": {**g, "stop_regex": "("},
        },
        "stop_regex_uncompilable": {
            "text": "page",
            "sampling_params": {**g, "stop_regex": "(?<=a+)b"},
        },
        "text_with_nested_input_ids": {
            "text": "page",
            "input_ids": [[]],
            "sampling_params": g,
        },
        "rid_list_single_prompt": {
            "text": "page",
            "rid": ["a", "b"],
            "sampling_params": g,
        },
        "sampling_params_list_single_prompt": {
            "text": "page",
            "sampling_params": [g, g],
        },
        "sampling_params_list_short": {
            "text": ["page", "layer", "cache"],
            "sampling_params": [g, g],
        },
    }
    oai = {
        "completions_prompt_id_past_vocab": {"prompt": [vocab + 9]},
        "completions_prompt_id_negative": {"prompt": [-1]},
        "completions_prompt_empty_list": {"prompt": []},
        "completions_prompt_empty": {"prompt": ""},
        "completions_logprobs_past_vocab": {"prompt": "page", "logprobs": 100000},
        "completions_logit_bias_past_vocab": {
            "prompt": "page",
            "logit_bias": {str(vocab + 5): 1},
        },
        "completions_stop_id_past_vocab": {
            "prompt": "page",
            "stop_token_ids": [vocab + 5],
            "min_tokens": 1,
        },
        "completions_top_k_past_int32": {"prompt": "page", "top_k": 10**10},
        "completions_stop_regex_invalid": {"prompt": "page", "stop_regex": "("},
        "completions_logit_bias_past_float32": {
            "prompt": "page",
            "logit_bias": {"5": -1e39},
        },
        "completions_n_zero": {"prompt": "page", "n": 0},
    }
    chat = {
        "chat_messages_empty": {"messages": []},
        "chat_top_logprobs_past_vocab": {
            "messages": CHAT,
            "logprobs": True,
            "top_logprobs": 100000,
        },
        "chat_logit_bias_past_vocab": {
            "messages": CHAT,
            "logit_bias": {str(vocab + 5): 1},
        },
        "chat_stop_id_past_vocab": {
            "messages": CHAT,
            "stop_token_ids": [vocab + 5],
            "min_tokens": 1,
        },
        "chat_top_k_past_int32": {"messages": CHAT, "top_k": 10**10},
        "chat_stop_regex_invalid": {"messages": CHAT, "stop_regex": "["},
        "chat_schema_invalid": {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "bogus"}},
            },
        },
    }
    out = {name: ("/generate", body) for name, body in gen.items()}
    for name, body in oai.items():
        out[name] = ("/v1/completions", {"model": "m", "max_tokens": 2, **body})
    for name, body in chat.items():
        out[name] = ("/v1/chat/completions", {"model": "m", "max_tokens": 2, **body})
    return out


def _pools(vocab: int) -> dict[str, list]:
    ints = [-(2**63), -5, -2, -1, 0, 1, vocab - 1, vocab, vocab + 1, 10**9, 2**64]
    ids = [[], [vocab], [-1], [0, vocab - 1], [vocab * 1000], [1.5], ["a"], [None]]
    odd = [None, True, "x", "", 1.5, [], {}, [[]], "x" * 5000]
    return dict(ints=ints, ids=ids, odd=odd)


# field -> pools its values are drawn from (prompt-level, sampling_params,
# OpenAI completions).
_GEN_FIELDS = {
    "text": ("odd",),
    "input_ids": ("ids", "odd"),
    "return_logprob": ("odd",),
    "top_logprobs_num": ("ints", "odd"),
    "logprob_start_len": ("ints", "odd"),
    "token_ids_logprob": ("ids", "odd"),
    "stream": ("odd",),
    "rid": ("odd",),
}
_SAMPLING_FIELDS = {
    "max_new_tokens": ("ints", "odd"),
    "min_new_tokens": ("ints", "odd"),
    "temperature": ("ints", "odd"),
    "top_p": ("ints", "odd"),
    "top_k": ("ints", "odd"),
    "min_p": ("ints", "odd"),
    "frequency_penalty": ("ints", "odd"),
    "presence_penalty": ("ints", "odd"),
    "repetition_penalty": ("ints", "odd"),
    "stop": ("odd",),
    "stop_token_ids": ("ids", "odd"),
    "logit_bias": ("logit_bias", "odd"),
    "n": ("small_n", "odd"),
    "regex": ("odd",),
    "json_schema": ("odd",),
    "ignore_eos": ("odd",),
    "sampling_seed": ("ints", "odd"),
}
_COMPLETION_FIELDS = {
    "prompt": ("ids", "odd"),
    "max_tokens": ("ints", "odd"),
    "logprobs": ("ints", "odd"),
    "temperature": ("ints", "odd"),
    "top_p": ("ints", "odd"),
    "stop_token_ids": ("ids", "odd"),
    "logit_bias": ("logit_bias", "odd"),
    "n": ("small_n", "odd"),
    "echo": ("odd",),
    "min_tokens": ("ints", "odd"),
}

# Valid values that cost real work (large n, long outputs) are never drawn.
_BOUNDED = {"max_new_tokens", "max_tokens", "min_new_tokens", "min_tokens"}


def _draw(rng, field, pools_of, pools, vocab):
    pool = rng.choice(pools_of[field])
    if pool == "logit_bias":
        return rng.choice([{str(vocab): 1.0}, {"-1": 1.0}, {"x": 1}, {"0": "x"}])
    if pool == "small_n":
        return rng.choice([0, -1, 2])
    value = rng.choice(pools[pool])
    if field in _BOUNDED and (value is None or isinstance(value, int) and value > 64):
        value = 10**9  # past the context: refused (None: up to the context)
    return value


def random_cases(seed: int, n: int, vocab: int) -> dict[str, tuple[str, dict]]:
    """``n`` seeded mutations of valid requests: ``{name: (path, body)}``."""
    rng = random.Random(seed)
    pools = _pools(vocab)
    out = {}
    for i in range(n):
        route = rng.choice(("generate", "generate", "sampling", "completions"))
        if route == "completions":
            path = "/v1/completions"
            body = {"model": "m", "prompt": "page layer", "max_tokens": 2}
            fields, target = _COMPLETION_FIELDS, body
        else:
            path = "/generate"
            body = {"text": "page layer", "sampling_params": dict(GREEDY)}
            if route == "generate":
                fields, target = _GEN_FIELDS, body
            else:
                fields, target = _SAMPLING_FIELDS, body["sampling_params"]
        changed = rng.sample(sorted(fields), rng.choice((1, 1, 2)))
        for field in changed:
            target[field] = _draw(rng, field, fields, pools, vocab)
        if "text" in changed and "input_ids" in changed:
            body.pop("text")
        out[f"random{i:03d}:{route}:{'+'.join(changed)}"] = (path, body)
    return out


def _post(base_url, path, body, timeout):
    data = json.dumps(body, allow_nan=True)
    return requests.post(
        base_url + path,
        data=data,
        headers={"Content-Type": "application/json"},
        timeout=timeout,
    )


# A scheduler that dies takes the tree down after 0.5.23's crash path: the
# py-spy dump attempt and a 60 s wait for CUDA coredumps nobody triggered
# (fixes/0012 drops that wait); twice that bounds a death.
DEATH_WAIT_S = 150.0
HANG_PROBE_S = 10.0


def _serves(base_url: str, timeout: float) -> bool:
    try:
        good = _post(base_url, "/generate", GOOD, timeout)
        return good.status_code == 200 and len(good.json()["output_ids"]) > 0
    except (requests.RequestException, ValueError, KeyError):
        return False


def run_cases(
    base_url: str,
    cases: dict,
    timeout: float = 60.0,
    tree_pids=None,
) -> list[dict]:
    """``GOOD`` (the server serves, and its prompt is cached), then each case
    followed by ``GOOD``; ``[{name, status, body, alive, s, outcome}]`` up to
    and including the first case after which the server did not serve
    ``GOOD``. ``outcome``: ``served`` (alive), else, given ``tree_pids`` (a
    callable returning the server's process tree), ``died`` (the tree exited
    within ``DEATH_WAIT_S`` of the case, ``exit_s`` after it) or ``hung``
    (still running then, and ``GOOD`` still not served); ``down`` without."""
    first = _post(base_url, "/generate", GOOD, timeout)
    assert first.status_code == 200, first.text[:500]
    out = []
    for name, (path, body) in cases.items():
        pids = tree_pids() if tree_pids else []
        start = time.monotonic()
        try:
            resp = _post(base_url, path, body, timeout)
            status, text = resp.status_code, resp.text
        except requests.RequestException as exc:
            status, text = None, f"{type(exc).__name__}: {exc}"
        elapsed = time.monotonic() - start
        alive = _serves(base_url, timeout)
        record = dict(
            name=name,
            status=status,
            body=text[:100_000],
            alive=alive,
            s=elapsed,
            outcome="served" if alive else "down",
        )
        if not alive and tree_pids:
            left = DEATH_WAIT_S - (time.monotonic() - start)
            if not wait_gone(pids, max(left, 0.0)):
                record.update(outcome="died", exit_s=time.monotonic() - start)
            elif not _serves(base_url, HANG_PROBE_S):
                record.update(outcome="hung")
            else:  # it came back: neither; the caller's assertion names it
                record.update(outcome="recovered")
        out.append(record)
        if not alive:
            break
    return out


# The error JSON each route documents (0.5.23's http_server and OpenAI
# serving_base): a ValueError on a native route is {"error": {"message"}}
# (http_server._create_error_response); a /generate body its schema contract
# refuses (api_contract.generate_contract_error, a wrong type in a field) is
# {"error": "<violation>"}; a request FastAPI refuses before the route (a
# body that does not parse or validate), and every OpenAI error, is the flat
# ErrorResponse {"object": "error", "message", "type", "param", "code"} with
# ``code`` the status.
NATIVE_ROUTES = ("/generate",)
OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")
_FLAT_KEYS = {"object", "message", "type", "param", "code"}


def error_shape(path: str, status: int, body: str) -> str:
    """The message of a 4xx ``body`` on ``path``; raises AssertionError naming
    what does not fit the route's documented error JSON."""
    try:
        data = json.loads(body)
    except ValueError:
        raise AssertionError(f"{path} {status}: not JSON: {body[:200]!r}")
    if not isinstance(data, dict):
        raise AssertionError(f"{path} {status}: not an object: {body[:200]!r}")
    if path in NATIVE_ROUTES and set(data) == {"error"}:
        err = data["error"]
        if isinstance(err, str):  # /generate's contract check (api_contract)
            message = err
        elif isinstance(err, dict) and set(err) == {"message"}:
            message = err["message"]
        else:
            raise AssertionError(f"{path} {status}: error is not {{message}}: {err}")
    elif path in NATIVE_ROUTES + OPENAI_ROUTES:
        if set(data) != _FLAT_KEYS:
            raise AssertionError(
                f"{path} {status}: keys {sorted(data)}, not {sorted(_FLAT_KEYS)}"
            )
        if data["object"] != "error" or data["code"] != status:
            raise AssertionError(
                f"{path} {status}: object {data['object']!r}, code {data['code']!r}"
            )
        if not isinstance(data["type"], str) or not data["type"]:
            raise AssertionError(f"{path} {status}: no error type: {data}")
        message = data["message"]
    else:
        raise AssertionError(f"no documented error shape for {path}")
    if not isinstance(message, str) or not message.strip():
        raise AssertionError(f"{path} {status}: empty message: {body[:200]!r}")
    return message
