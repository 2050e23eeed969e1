"""Expert distribution routes on a server without a recorder answer 400.

On 0.5.23 one ``GET /start_expert_distribution_record`` (or stop, or dump)
to a server started without ``--expert-distribution-recorder-mode`` took
the whole server down: the scheduler holds the no-op recorder, whose every
action raises, and the exception ends the scheduler's event loop (found by
the schema fuzz of every route, ``harness.schema_fuzz``).

The real endpoints (``http_server.app`` through starlette's TestClient) on a
tokenizer manager whose scheduler link runs the real
``Scheduler.expert_distribution_handle``: each route answers 400 naming the
flag, and nothing reaches the scheduler; with a recorder mode set the action
still goes to the scheduler.
"""

import unittest
from types import SimpleNamespace

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_with_a_recorder_mode_the_action_reaches_the_scheduler": "a server with a recorder forwards as upstream does",
}

ROUTES = (
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
)


class TestExpertDistributionWithoutRecorder(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from fastapi.testclient import TestClient
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        cls.http_server = http_server
        cls.saved_state = http_server.get_global_state()
        cls.sent = []
        scheduler = object.__new__(Scheduler)

        async def communicator(req):
            # What the scheduler does with it (its event loop dies on a raise).
            cls.sent.append(req.action)
            return [scheduler.expert_distribution_handle(req)]

        cls.manager = object.__new__(TokenizerManager)
        cls.manager.auto_create_handle_loop = lambda: None
        cls.manager.expert_distribution_communicator = communicator
        http_server.set_global_state(
            http_server._GlobalState(
                tokenizer_manager=cls.manager,
                template_manager=None,
                scheduler_info={},
            )
        )
        cls.client = TestClient(http_server.app, raise_server_exceptions=False)

    @classmethod
    def tearDownClass(cls):
        cls.http_server.set_global_state(cls.saved_state)

    def setUp(self):
        self.sent.clear()

    def test_without_a_recorder_mode_each_route_answers_400(self):
        self.manager.server_args = SimpleNamespace(
            expert_distribution_recorder_mode=None
        )
        for route in ROUTES:
            for method in ("GET", "POST"):
                with self.subTest(route=route, method=method):
                    resp = self.client.request(method, route)
                    self.assertEqual(resp.status_code, 400, resp.text)
                    message = resp.json()["error"]["message"]
                    self.assertIn("--expert-distribution-recorder-mode", message)
        self.assertEqual(self.sent, [], "a request reached the scheduler")

    def test_with_a_recorder_mode_the_action_reaches_the_scheduler(self):
        from sglang.srt.eplb import expert_distribution

        self.manager.server_args = SimpleNamespace(
            expert_distribution_recorder_mode="stat"
        )
        calls = []

        class Recorder:
            def start_record(self):
                calls.append("start")

            def stop_record(self):
                calls.append("stop")

            def dump_record(self):
                calls.append("dump")

        saved = expert_distribution.get_global_expert_distribution_recorder()
        expert_distribution.set_global_expert_distribution_recorder(Recorder())
        try:
            for route in ROUTES:
                resp = self.client.get(route)
                self.assertEqual(resp.status_code, 200, resp.text)
        finally:
            expert_distribution.set_global_expert_distribution_recorder(saved)
        self.assertEqual(calls, ["start", "stop", "dump"])
        self.assertEqual(len(self.sent), 3)


if __name__ == "__main__":
    unittest.main()
