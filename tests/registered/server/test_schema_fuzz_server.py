"""Every route of ``/openapi.json`` fuzzed from its schema on a live server.

One patched server (every feature off) with ``--admin-api-key`` gets a short
seeded run of ``harness.schema_fuzz`` (schemathesis: ``EXAMPLES`` cases per
operation in its positive and negative generation modes): every operation the
server publishes is called except the ones ``schema_fuzz.EXCLUDED`` names
with the reason (they stop or reshape the server by design); each case is
sent without the key, where an admin route must answer 401, and with it on
an admin route; no answer is a 5xx or takes longer than ``CASE_TIMEOUT_S``,
and after each case a greedy ``/generate`` gives its first output (no case
changes the server). The findings not fixed yet are ``schema_fuzz.KNOWN``'s,
each with its route, outcome and reason; nothing else is let through.

Before the fuzz, the two requests it found on 0.5.23 (fixes/0014, fixes/0016;
their unit PR tests show pristine failing): a ``/configure_logging`` whose
level is out of range answers 400 naming the field and its accepted values,
and the next requests are served (0.5.23 answered 500 to every request from
then on); ``/detokenize`` of ids outside the vocabulary answers 400.

``TestSchemaFuzzHarness`` is the harness' own negative control: a small
stdlib HTTP server with a route that answers 500, one that changes the good
request's output and an admin route open without the key; the fuzz must
report each.
"""

import json
import threading
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests
from sglang.test.ci.ci_register import register_cpu_ci

from harness import schema_fuzz, shared_servers

register_cpu_ci(est_time=120, suite="base-b-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PROJECT_ONLY = "runs this project's CPU server"

ADMIN_KEY = "schema-fuzz-admin-key"
SEED, EXAMPLES = 23, 1
CASE_TIMEOUT_S = 30.0
VOCAB = 2048  # scripts/tiny_model.py


def _fixed_cases(server):
    """The two requests 0.5.23 answered 500, each followed by a good one."""
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    out = {}
    before = schema_fuzz.good_request(server.base_url, CASE_TIMEOUT_S)[0]
    bad = {"log_requests": "yes", "log_requests_level": 1000000000}
    resp = requests.post(
        f"{server.base_url}/configure_logging", json=bad, headers=auth, timeout=30
    )
    after = [
        schema_fuzz.good_request(server.base_url, CASE_TIMEOUT_S)[0] for _ in range(3)
    ]
    out["configure_logging"] = dict(
        status=resp.status_code, body=resp.text, before=before, after=after
    )
    resp = requests.post(
        f"{server.base_url}/detokenize", json={"tokens": [VOCAB + 99, -1]}, timeout=30
    )
    out["detokenize"] = dict(status=resp.status_code, body=resp.text)
    return out


def _fuzz(server):
    admin = schema_fuzz.admin_paths()
    spec = requests.get(f"{server.base_url}/openapi.json", timeout=30).json()
    fixed = _fixed_cases(server)
    report = schema_fuzz.run(
        server.base_url,
        seed=SEED,
        examples=EXAMPLES,
        admin_key=ADMIN_KEY,
        admin=admin,
        case_timeout=CASE_TIMEOUT_S,
    )
    return dict(spec=spec, admin=admin, fixed=fixed, report=report)


KEY = shared_servers.work(
    "patched", schema_fuzz.server_args(ADMIN_KEY), name="schema-fuzz", fn=_fuzz
)


class TestSchemaFuzzServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.result = shared_servers.result(KEY, "schema-fuzz")
        cls.report = cls.result["report"]

    def test_no_case_answers_5xx_times_out_or_changes_the_server(self):
        report = self.report
        self.assertEqual(report.stopped, "", report.stopped)
        findings = [
            (r.label, r.mode, r.outcome, r.status, r.detail[:200], r.request[:400])
            for r in report.findings()
        ]
        self.assertEqual(findings, [])
        # A known finding names its route, its outcome and why it is left.
        for (method, path), (outcome, why) in schema_fuzz.KNOWN.items():
            self.assertIn(path, self.result["spec"]["paths"])
            self.assertIn(outcome, ("5xx", "timeout", "state"))
            self.assertGreater(len(why), 40)
        # The fuzz reached both answers: served and refused.
        statuses = {(r.status or 0) // 100 for r in report.records}
        self.assertTrue({2, 4} <= statuses, statuses)

    def test_every_published_operation_is_fuzzed_or_excluded_with_a_reason(self):
        published = {
            f"{method.upper()} {path}"
            for path, ops in self.result["spec"]["paths"].items()
            for method in ops
        }
        fuzzed = {r.label for r in self.report.records}
        excluded = {
            label
            for label, why in self.report.skipped.items()
            if label.split()[1] in schema_fuzz.EXCLUDED
        }
        self.assertEqual(set(self.report.skipped), excluded, self.report.skipped)
        self.assertEqual(fuzzed | excluded, published)
        self.assertEqual(fuzzed & excluded, set())
        self.assertGreater(len(fuzzed), 80)
        self.assertTrue(all(schema_fuzz.EXCLUDED.values()))
        # Every excluded path is a route the server publishes.
        paths = set(self.result["spec"]["paths"])
        self.assertLessEqual(set(schema_fuzz.EXCLUDED), paths)

    def test_admin_routes_answer_401_without_the_key(self):
        admin = self.result["admin"]
        admin_records = [r for r in self.report.records if r.path in admin]
        self.assertGreater(len({r.path for r in admin_records}), 20)
        for r in admin_records:
            self.assertEqual(r.unauth_status, 401, (r.label, r.request))
            self.assertNotEqual(r.status, 401, (r.label, r.request))
        for r in self.report.records:
            if r.path not in admin:
                self.assertNotEqual(r.unauth_status, 401, (r.label, r.request))
        self.assertIn("/configure_logging", admin)

    def test_configure_logging_out_of_range_answers_400_and_changes_nothing(self):
        case = self.result["fixed"]["configure_logging"]
        self.assertEqual(case["status"], 400, case)
        message = json.loads(case["body"])["error"]["message"]
        self.assertIn("log_requests_level", message)
        self.assertIn("[0, 1, 2, 3]", message)
        self.assertIsNotNone(case["before"])
        self.assertEqual(case["after"], [case["before"]] * 3, case)

    def test_detokenize_outside_the_vocabulary_answers_400(self):
        case = self.result["fixed"]["detokenize"]
        self.assertEqual(case["status"], 400, case)
        body = json.loads(case["body"])
        self.assertEqual(body["code"], 400, body)
        self.assertIn("tokens", body["message"])
        self.assertIn(f"[0, {VOCAB})", body["message"])


# -- the harness' own negative control: a stand-in server with three bugs --
SPEC = {
    "openapi": "3.1.0",
    "info": {"title": "stand-in", "version": "0"},
    "paths": {
        "/generate": {
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
                "responses": {"200": {"description": "ok"}},
            }
        },
        "/crash": {
            "post": {
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {"x": {"type": "integer"}},
                                "required": ["x"],
                            }
                        }
                    },
                },
                "responses": {"200": {"description": "ok"}},
            }
        },
        "/toggle": {"get": {"responses": {"200": {"description": "ok"}}}},
        "/admin_open": {"get": {"responses": {"200": {"description": "ok"}}}},
        "/start_profile": {"get": {"responses": {"200": {"description": "ok"}}}},
    },
}


class _StandIn(BaseHTTPRequestHandler):
    toggled = False

    def log_message(self, *args):
        pass

    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/openapi.json":
            return self._answer(200, SPEC)
        if path == "/toggle":
            _StandIn.toggled = True
            return self._answer(200, {})
        if path == "/start_profile":
            raise AssertionError("an excluded route was called")
        return self._answer(200, {})  # /admin_open: no key asked

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            return self._answer(400, {"error": "not JSON"})
        path = self.path.split("?")[0]
        if path == "/generate":
            ids = [7, 9] if _StandIn.toggled else [5, 6]
            return self._answer(200, {"text": "t", "output_ids": ids})
        if path == "/crash":
            if not isinstance(body, dict) or not isinstance(body.get("x"), int):
                return self._answer(400, {"error": "x"})
            return self._answer(500 if body["x"] < 0 else 200, {})
        return self._answer(404, {})


class TestSchemaFuzzHarness(unittest.TestCase):
    def test_the_fuzz_reports_a_5xx_a_state_change_and_an_open_admin_route(self):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            report = schema_fuzz.run(
                url,
                seed=SEED,
                examples=30,
                admin_key="k",
                admin={"/admin_open"},
                case_timeout=10,
            )
        finally:
            server.shutdown()
            server.server_close()
        outcomes = {(r.label, r.outcome) for r in report.findings()}
        self.assertIn(("POST /crash", "5xx"), outcomes)
        self.assertIn(("GET /toggle", "state"), outcomes)
        self.assertIn(("GET /admin_open", "auth"), outcomes)
        self.assertEqual(set(report.skipped), {"GET /start_profile"})
        # Per route, the table counts every case.
        table = schema_fuzz.table(report)
        self.assertIn("POST /crash", table)

    def test_bound_cost_caps_counts_at_any_depth(self):
        body = {
            "sampling_params": {"max_new_tokens": 10**9, "n": 5},
            "max_tokens": -3,
            "items": [{"max_tokens": 99}],
            "text": "max_tokens",
        }
        self.assertEqual(
            schema_fuzz.bound_cost(body),
            {
                "sampling_params": {"max_new_tokens": 4, "n": 2},
                "max_tokens": -3,
                "items": [{"max_tokens": 4}],
                "text": "max_tokens",
            },
        )


if __name__ == "__main__":
    unittest.main()
