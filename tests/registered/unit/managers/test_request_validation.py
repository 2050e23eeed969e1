"""Requests that would crash the scheduler are refused at the tokenizer manager.

A prompt token id outside the vocabulary, an empty prompt, an
out-of-vocabulary stop token id, ``top_logprobs_num`` past the vocabulary and
``logprob_start_len`` below -1 each took a live 0.5.23 server down (the
scheduler died, the launcher stopped everything). The real
``TokenizerManager._validate_one_request`` (on a manager holding a real
``ModelConfig`` of a 100-token vocabulary) and the real
``SamplingParams.verify`` must refuse them with a ``ValueError`` naming the
field (the HTTP layer answers 400), and keep accepting every boundary value.
The HTTP server's validation-error handler answers without the endpoint
context FastAPI appends (the server's file, line and function).
"""

import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_multimodal_pad_values_are_left_to_the_processor": "the fix leaves multimodal prompts as upstream has them"
}

VOCAB = 100


def make_manager():
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    path = tempfile.mkdtemp(prefix="validation-model-")
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    server_args = ServerArgs(model_path=path, device="cpu")
    publish(server_args, role="tokenizer")
    # The validation reads these attributes only; the constructor would start
    # the tokenizer, the ZMQ sockets and the detokenizer link.
    manager = object.__new__(TokenizerManager)
    manager.model_config = ModelConfig.from_server_args(server_args)
    manager.context_len = manager.model_config.context_len
    manager.allow_auto_truncate = False
    manager.validate_total_tokens = True
    manager.num_reserved_tokens = 0
    manager.is_generation = True
    return manager


def request(input_ids, **fields):
    from sglang.srt.managers.io_struct import GenerateReqInput

    fields.setdefault("sampling_params", {"max_new_tokens": 2})
    obj = GenerateReqInput(input_ids=input_ids, **fields)
    if input_ids:  # normalize refuses a bare empty list itself
        obj.normalize_batch_and_arguments()
    return obj


class TestRequestValidation(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.manager = make_manager()
        assert cls.manager.model_config.vocab_size == VOCAB

    def refused(self, obj, ids, field):
        with self.assertRaises(ValueError) as ctx:
            self.manager._validate_one_request(obj, ids)
        self.assertIn(field, str(ctx.exception))
        return str(ctx.exception)

    def accepted(self, obj, ids):
        self.manager._validate_one_request(obj, ids)

    def test_prompt_ids_outside_the_vocabulary(self):
        for ids in ([5, VOCAB, 7], [5, 999999], [-1, 5], [5, -VOCAB]):
            with self.subTest(ids=ids):
                message = self.refused(request(ids), list(ids), "input_ids")
                self.assertIn(f"[0, {VOCAB})", message)
        self.accepted(request([0, VOCAB - 1]), [0, VOCAB - 1])

    def test_empty_prompt(self):
        # `text` that tokenizes to nothing reaches validation as [].
        obj = request(None, text="")
        obj.normalize_batch_and_arguments()
        self.refused(obj, [], "prompt is empty")
        # A session may supply the whole prompt from its history.
        obj = request([5], session_params={"id": "s1"})
        self.accepted(obj, [])

    def test_multimodal_pad_values_are_left_to_the_processor(self):
        # Multimodal prompts carry hash-derived pad values past the vocabulary.
        obj = request([5, 10**9], image_data="data:image/png;base64,AAAA")
        self.accepted(obj, [5, 10**9])

    def test_logprob_arguments(self):
        self.refused(
            request([5], return_logprob=True, top_logprobs_num=VOCAB + 1),
            [5],
            "top_logprobs_num",
        )
        self.refused(
            request([5], return_logprob=True, logprob_start_len=-2),
            [5],
            "logprob_start_len",
        )
        for fields in (
            dict(top_logprobs_num=VOCAB),
            dict(logprob_start_len=-1),
            dict(logprob_start_len=0),
        ):
            with self.subTest(**fields):
                self.accepted(request([5, 6], return_logprob=True, **fields), [5, 6])
        # Without return_logprob the arguments are not used.
        self.accepted(request([5], top_logprobs_num=VOCAB + 1), [5])

    def test_stop_token_ids(self):
        from sglang.srt.sampling.sampling_params import SamplingParams

        for ids in ([VOCAB], [3, 999999], [-1]):
            with self.subTest(ids=ids):
                with self.assertRaises(ValueError) as ctx:
                    SamplingParams(stop_token_ids=ids, min_new_tokens=1).verify(VOCAB)
                self.assertIn("stop_token_ids", str(ctx.exception))
        SamplingParams(stop_token_ids=[0, VOCAB - 1]).verify(VOCAB)


class TestValidationErrorBody(unittest.TestCase):
    def test_no_server_path_in_the_body(self):
        import asyncio
        import json

        from fastapi.exceptions import RequestValidationError
        from sglang.srt.entrypoints.http_server import app
        from starlette.requests import Request

        handler = app.exception_handlers[RequestValidationError]
        error = {"type": "int_type", "loc": ("body", "top_p"), "msg": "bad"}
        exc = RequestValidationError(
            [error],
            endpoint_ctx={
                "file": "/opt/site-packages/sglang/srt/entrypoints/http_server.py",
                "line": 928,
                "function": "generate_request",
                "path": "POST /generate",
            },
        )
        self.assertIn("http_server.py", str(exc))  # what FastAPI's text carries
        scope = {"type": "http", "path": "/generate", "headers": [], "root_path": ""}
        resp = asyncio.run(handler(Request(scope), exc))
        body = json.loads(resp.body)
        self.assertEqual(resp.status_code, 400)
        self.assertEqual(body["code"], 400)
        self.assertIn("top_p", body["message"])
        self.assertNotIn("http_server.py", body["message"])
        self.assertNotIn("site-packages", body["message"])


if __name__ == "__main__":
    unittest.main()
