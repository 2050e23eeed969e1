"""``/v1/loads?include=`` with an unknown section answers 400, not 500.

On 0.5.23 the sections were checked only while the response was built
(``LoadSnapshot.to_dict``), after the loads were gathered, and the
ValueError there was answered 500 (found by the schema fuzz of every route,
``harness.schema_fuzz``). The real endpoint (``http_server.app`` through
starlette's TestClient) on a tokenizer manager that returns one real
``LoadSnapshot``: an unknown section answers 400 naming it and the valid
options, before any load is gathered; known sections are served.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_known_sections_are_served": "valid sections are served as upstream serves them",
}


class TestLoadsIncludeValidation(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from fastapi.testclient import TestClient
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.load_snapshot import LoadSnapshot
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        cls.http_server = http_server
        cls.saved_state = http_server.get_global_state()
        cls.gathered = []

        async def get_loads(include=None, dp_rank=None):
            cls.gathered.append(include)
            return [LoadSnapshot(dp_rank=0, num_running_reqs=3)]

        manager = object.__new__(TokenizerManager)
        manager.get_loads = get_loads
        manager.metrics_collector = None
        http_server.set_global_state(
            http_server._GlobalState(
                tokenizer_manager=manager, template_manager=None, scheduler_info={}
            )
        )
        cls.client = TestClient(http_server.app, raise_server_exceptions=False)

    @classmethod
    def tearDownClass(cls):
        cls.http_server.set_global_state(cls.saved_state)

    def setUp(self):
        self.gathered.clear()

    def test_unknown_sections_answer_400_naming_them(self):
        for include, bad in (("bogus", "bogus"), ("core,xyz", "xyz"), ("core,", "")):
            for fmt in ("json", "prometheus"):
                with self.subTest(include=include, format=fmt):
                    resp = self.client.get(
                        "/v1/loads", params={"include": include, "format": fmt}
                    )
                    self.assertEqual(resp.status_code, 400, resp.text)
                    self.assertIn(repr(bad), resp.text)
                    self.assertIn("'queues'", resp.text)  # the valid options
        self.assertEqual(self.gathered, [], "loads gathered for a refused request")

    def test_known_sections_are_served(self):
        resp = self.client.get(
            "/v1/loads", params={"include": "core,memory", "format": "prometheus"}
        )
        self.assertEqual(resp.status_code, 200, resp.text)
        self.assertIn('sglang_num_running_reqs{dp_rank="0"} 3', resp.text)
        self.assertEqual(self.gathered, [["core", "memory"]])


if __name__ == "__main__":
    unittest.main()
