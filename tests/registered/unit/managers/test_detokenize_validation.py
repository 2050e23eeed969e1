"""``/detokenize`` refuses token ids outside the vocabulary with 400.

On 0.5.23 ``{"tokens": [2147, -1]}`` on a 2048-token model answered 500
("Internal server error during detokenization"): the tokenizer raises
OverflowError on a negative id (or one past 64 bits), while an id past the
vocabulary alone decoded to an empty text. The real endpoint
(``http_server.app`` through starlette's TestClient) with the real
``OpenAIServingDetokenize`` on a real fast tokenizer of a 16-token vocabulary
must answer each such request 400 naming ``tokens`` and the valid range, and
keep decoding every id inside it.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_ids_inside_the_vocabulary_are_decoded": "valid ids decode as upstream decodes them"
}

VOCAB = 16


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class TestDetokenizeValidation(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from types import SimpleNamespace

        from fastapi.testclient import TestClient
        from sglang.srt.entrypoints import http_server
        from sglang.srt.entrypoints.openai.serving_tokenize import (
            OpenAIServingDetokenize,
        )
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.utils.request_logger import RequestLogger

        manager = object.__new__(TokenizerManager)
        manager.tokenizer = make_tokenizer()
        manager.model_config = SimpleNamespace(vocab_size=VOCAB)
        manager.server_args = None
        manager.request_logger = RequestLogger(
            log_requests=False,
            log_requests_level=2,
            log_requests_format="text",
            log_requests_target=None,
        )
        cls.tokenizer = manager.tokenizer
        cls.app = http_server.app
        cls.saved = getattr(cls.app.state, "openai_serving_detokenize", None)
        cls.app.state.openai_serving_detokenize = OpenAIServingDetokenize(manager)
        # No lifespan (no `with`): the route reads app.state only.
        cls.client = TestClient(cls.app, raise_server_exceptions=False)

    @classmethod
    def tearDownClass(cls):
        cls.app.state.openai_serving_detokenize = cls.saved

    def detokenize(self, tokens):
        return self.client.post("/detokenize", json={"tokens": tokens})

    def test_ids_outside_the_vocabulary_answer_400_naming_tokens(self):
        for tokens, bad in (
            ([VOCAB + 99, -1], VOCAB + 99),
            ([3, -1], -1),
            ([VOCAB], VOCAB),
            ([2**63], 2**63),
            ([[1, 2], [5, VOCAB]], VOCAB),
        ):
            with self.subTest(tokens=tokens):
                resp = self.detokenize(tokens)
                self.assertEqual(resp.status_code, 400, resp.text)
                body = resp.json()
                self.assertEqual(body["code"], 400, body)
                self.assertIn("tokens", body["message"])
                self.assertIn(str(bad), body["message"])
                self.assertIn(f"[0, {VOCAB})", body["message"])
                # The next request is served.
                self.assertEqual(self.detokenize([1]).status_code, 200)

    def test_ids_inside_the_vocabulary_are_decoded(self):
        for tokens in ([0, VOCAB - 1], [[1, 2], [VOCAB - 1]], []):
            with self.subTest(tokens=tokens):
                resp = self.detokenize(tokens)
                self.assertEqual(resp.status_code, 200, resp.text)
                if tokens and isinstance(tokens[0], list):
                    expected = [self.tokenizer.decode(t) for t in tokens]
                else:
                    expected = self.tokenizer.decode(tokens)
                self.assertEqual(resp.json()["text"], expected)


if __name__ == "__main__":
    unittest.main()
