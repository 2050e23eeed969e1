"""``/parse_function_call`` and ``/separate_reasoning`` with a parser name
they do not know answer 400, not 500.

Found by the schema fuzz of every route (``harness.schema_fuzz``) on 0.5.23:
``FunctionCallParser`` raises ValueError for an unknown (or no)
``tool_call_parser`` and ``ReasoningParser`` for an unknown (or empty)
``reasoning_parser``; both endpoints let it through (HTTP 500). The real
endpoints (``http_server.app`` through starlette's TestClient): each such
request answers 400 with the parser's message, and known parsers still
parse.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_known_parsers_parse": "known parsers parse as upstream parses",
}


class TestParserNameRefusals(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from types import SimpleNamespace

        from fastapi.testclient import TestClient
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        cls.http_server = http_server
        cls.saved_state = http_server.get_global_state()
        cls.saved_chat = getattr(http_server.app.state, "openai_serving_chat", None)
        manager = object.__new__(TokenizerManager)
        manager.tokenizer = None
        http_server.set_global_state(
            http_server._GlobalState(
                tokenizer_manager=manager, template_manager=None, scheduler_info={}
            )
        )
        http_server.app.state.openai_serving_chat = SimpleNamespace(
            chat_encoding_spec=None, encoding_adapter=None
        )
        cls.client = TestClient(http_server.app, raise_server_exceptions=False)

    @classmethod
    def tearDownClass(cls):
        cls.http_server.set_global_state(cls.saved_state)
        cls.http_server.app.state.openai_serving_chat = cls.saved_chat

    def test_unknown_parser_names_answer_400(self):
        for path, body, phrase in (
            (
                "/parse_function_call",
                {"text": "x", "tool_call_parser": "no-such-parser"},
                "Unsupported tool_call_parser: no-such-parser",
            ),
            ("/parse_function_call", {"text": "x"}, "tool_call_parser"),
            (
                "/separate_reasoning",
                {"text": "x", "reasoning_parser": "no-such-parser"},
                "Unsupported model type: no-such-parser",
            ),
            (
                "/separate_reasoning",
                {"text": "x", "reasoning_parser": ""},
                "Model type must be specified",
            ),
        ):
            with self.subTest(path=path, body=body):
                resp = self.client.post(path, json=body)
                self.assertEqual(resp.status_code, 400, resp.text)
                self.assertIn(phrase, resp.text)

    def test_known_parsers_parse(self):
        resp = self.client.post(
            "/separate_reasoning",
            json={"text": "<think>why</think>so", "reasoning_parser": "deepseek-r1"},
        )
        self.assertEqual(resp.status_code, 200, resp.text)
        self.assertEqual(resp.json()["reasoning_text"], "why")
        self.assertEqual(resp.json()["text"], "so")
        resp = self.client.post(
            "/parse_function_call",
            json={"text": "plain text", "tool_call_parser": "llama3"},
        )
        self.assertEqual(resp.status_code, 200, resp.text)
        self.assertEqual(resp.json()["calls"], [])


if __name__ == "__main__":
    unittest.main()
