"""Admin requests the server cannot take answer 400, not 500.

Found by the schema fuzz of every route (``harness.schema_fuzz``) on 0.5.23:
``/add_external_corpus`` and ``/remove_external_corpus`` with a body that is
not JSON (orjson's decode error, HTTP 500), ``/remove_external_corpus`` with
a JSON body that is not an object (AttributeError, 500), and
``/stop_profile`` while no profile runs (the scheduler's refusal raised as a
RuntimeError, 500). The real endpoints (``http_server.app`` through
starlette's TestClient) on a tokenizer manager whose scheduler link answers
as the scheduler does: each answers 400 with the reason, and valid requests
are served.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_valid_requests_are_served": "valid requests are served as upstream serves them",
}


class TestAdminRouteRefusals(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from types import SimpleNamespace

        from fastapi.testclient import TestClient
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.io_struct import ProfileReqOutput
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        cls.http_server = http_server
        cls.saved_state = http_server.get_global_state()
        cls.profiling = False
        cls.sent = []

        async def profile_communicator(req):
            # The scheduler's answer (profiler_manager._stop_profile).
            cls.sent.append("stop_profile")
            if not cls.profiling:
                return [
                    ProfileReqOutput(
                        success=False,
                        message="Profiling is not in progress. Call /start_profile first.",
                    )
                ]
            return [ProfileReqOutput(success=True, message="Succeeded")]

        async def remove_external_corpus(corpus_id):
            cls.sent.append(("remove", corpus_id))
            return SimpleNamespace(success=True, message="removed")

        async def add_external_corpus(obj):
            cls.sent.append(("add", obj.corpus_id))
            return SimpleNamespace(
                success=True,
                corpus_id=obj.corpus_id,
                message="added",
                loaded_token_count=1,
            )

        manager = object.__new__(TokenizerManager)
        manager.auto_create_handle_loop = lambda: None
        manager.profile_communicator = profile_communicator
        manager.remove_external_corpus = remove_external_corpus
        manager.add_external_corpus = add_external_corpus
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
        self.sent.clear()
        type(self).profiling = False

    def test_external_corpus_bodies_that_are_not_json_objects_answer_400(self):
        for path in ("/add_external_corpus", "/remove_external_corpus"):
            for body in (b"", b"{not json", b"[1, 2]", b'"corpus"'):
                with self.subTest(path=path, body=body):
                    resp = self.client.post(
                        path, content=body, headers={"Content-Type": "application/json"}
                    )
                    self.assertEqual(resp.status_code, 400, resp.text)
                    self.assertIs(resp.json()["success"], False)
                    self.assertTrue(resp.json()["message"])
        self.assertEqual(self.sent, [])

    def test_stop_profile_without_a_profile_answers_400(self):
        for method in ("GET", "POST"):
            with self.subTest(method=method):
                resp = self.client.request(method, "/stop_profile")
                self.assertEqual(resp.status_code, 400, resp.text)
                message = resp.json()["error"]["message"]
                self.assertIn("Profiling is not in progress", message)

    def test_valid_requests_are_served(self):
        type(self).profiling = True
        self.assertEqual(self.client.post("/stop_profile").status_code, 200)
        resp = self.client.post("/remove_external_corpus", json={"corpus_id": "c1"})
        self.assertEqual(resp.status_code, 200, resp.text)
        resp = self.client.post(
            "/add_external_corpus", json={"corpus_id": "c2", "documents": ["a b"]}
        )
        self.assertEqual(resp.status_code, 200, resp.text)
        self.assertEqual(self.sent, ["stop_profile", ("remove", "c1"), ("add", "c2")])


if __name__ == "__main__":
    unittest.main()
