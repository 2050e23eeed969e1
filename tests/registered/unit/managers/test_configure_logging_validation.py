"""A bad ``/configure_logging`` request is refused with 400 and changes nothing.

On 0.5.23 ``{"log_requests": "yes", "log_requests_level": 1000000000}`` (the
string is a bool to pydantic) set ``log_requests`` and the level on the
request logger before ``_compute_metadata`` refused the level: the endpoint
answered 500, and the logger was left logging with no metadata, so every
later request failed in ``log_received_request`` (HTTP 500 until a restart).
An unknown ``log_level`` likewise applied the request logger's fields before
``setLevel`` raised, and an unknown ``log_requests_format`` was taken as
``text``.

The real endpoint (``http_server.app`` through starlette's TestClient) runs
on a tokenizer manager holding a real ``RequestLogger``: each bad request
answers 400 naming the field and its accepted values, the logger's state is
what it was, and a request's logging path still works; a good request is
applied.
"""

import logging
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_a_good_request_is_applied": "valid settings are applied as upstream applies them"
}


def _state(logger):
    return (
        logger.log_requests,
        logger.log_requests_level,
        logger.log_requests_format,
        logger.metadata,
    )


class TestConfigureLoggingValidation(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from fastapi.testclient import TestClient
        from sglang.srt.entrypoints import http_server
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.utils.request_logger import RequestLogger

        cls.http_server = http_server
        cls.saved_state = http_server.get_global_state()
        cls.manager = object.__new__(TokenizerManager)
        cls.dispatched = []
        cls.manager._dispatch_to_scheduler = cls.dispatched.append
        cls.manager.dump_requests_folder = ""
        cls.manager.dump_requests_threshold = 1000
        cls.manager.dump_requests_exclude_meta_keys = None
        cls.manager.crash_dump_folder = None
        cls.manager.request_logger = RequestLogger(
            log_requests=False,
            log_requests_level=2,
            log_requests_format="text",
            log_requests_target=None,
        )
        http_server.set_global_state(
            http_server._GlobalState(
                tokenizer_manager=cls.manager,
                template_manager=None,
                scheduler_info={},
            )
        )
        # No lifespan (no `with`): the route reads the global state only.
        cls.client = TestClient(http_server.app, raise_server_exceptions=False)
        cls.root_level = logging.getLogger().level

    @classmethod
    def tearDownClass(cls):
        cls.http_server.set_global_state(cls.saved_state)
        logging.getLogger().setLevel(cls.root_level)

    def setUp(self):
        logger = self.manager.request_logger
        logger.configure(log_requests=False, log_requests_level=2)
        logger.configure(log_requests_format="text")
        self.dispatched.clear()

    def post(self, body):
        return self.client.post("/configure_logging", json=body)

    def assert_refused(self, body, *phrases):
        logger = self.manager.request_logger
        before = _state(logger)
        root_level = logging.getLogger().level
        resp = self.post(body)
        self.assertEqual(resp.status_code, 400, resp.text)
        message = resp.json()["error"]["message"]
        for phrase in phrases:
            self.assertIn(phrase, message)
        self.assertEqual(_state(logger), before, "a refused request changed state")
        self.assertEqual(logging.getLogger().level, root_level)
        self.assertEqual(self.dispatched, [])
        self.assert_logging_path_works()

    def assert_logging_path_works(self):
        from sglang.srt.managers.io_struct import GenerateReqInput

        logger = self.manager.request_logger
        obj = GenerateReqInput(text="page layer", sampling_params={})
        out = {"text": "x", "meta_info": {"e2e_latency": 0.01}}
        try:
            logger.log_received_request(obj)
            logger.log_finished_request(obj, out)
        except Exception as e:  # the request would answer 500
            self.fail(f"a request's logging raised {type(e).__name__}: {e}")

    def test_level_out_of_range_is_refused_and_changes_nothing(self):
        self.assert_refused(
            {"log_requests": "yes", "log_requests_level": 1000000000},
            "log_requests_level",
            "[0, 1, 2, 3]",
            "1000000000",
        )
        self.assert_refused(
            {"log_requests": True, "log_requests_level": -1}, "log_requests_level"
        )

    def test_unknown_format_is_refused(self):
        self.assert_refused(
            {"log_requests": True, "log_requests_format": "xml"},
            "log_requests_format",
            "['text', 'json']",
        )

    def test_unknown_log_level_is_refused_before_anything_applies(self):
        self.assert_refused(
            {"log_requests": True, "log_requests_level": 3, "log_level": "loud"},
            "log_level",
            "debug",
            "'loud'",
        )

    def test_a_good_request_is_applied(self):
        resp = self.post(
            {"log_requests": "yes", "log_requests_level": 3, "log_level": "warning"}
        )
        self.assertEqual(resp.status_code, 200, resp.text)
        logger = self.manager.request_logger
        self.assertEqual((logger.log_requests, logger.log_requests_level), (True, 3))
        self.assertEqual(logger.metadata[0], 1 << 30)
        self.assertEqual(logging.getLogger().level, logging.WARNING)
        self.assertEqual([r.log_level for r in self.dispatched], ["warning"])
        self.assert_logging_path_works()
        for level in (0, 1, 2):
            with self.subTest(level=level):
                resp = self.post({"log_requests_level": level})
                self.assertEqual(resp.status_code, 200, resp.text)
                self.assertEqual(logger.log_requests_level, level)
                self.assert_logging_path_works()


if __name__ == "__main__":
    unittest.main()
