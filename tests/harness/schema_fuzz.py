"""Every route a live server publishes in ``/openapi.json``, fuzzed from its
schema with schemathesis (Hypothesis strategies from the OpenAPI schema).

``run(server_url, ...)`` loads the server's own ``/openapi.json`` and, for
every operation (method and path) but the ``EXCLUDED`` ones, draws seeded
cases in schemathesis' two generation modes: ``positive`` (bodies, queries
and path parameters the schema accepts) and ``negative`` (ones it refuses).
Each case is sent:

- without credentials first when the server has an ``--admin-api-key``: an
  admin route (``admin_paths``, read from the route's ``@auth_level``) must
  answer 401 and change nothing, any other route is answered as it is;
- then, on an admin route, with the admin key, where it must behave.

Every answer must come within ``case_timeout`` and not be a 5xx. After each
case (and its ``RESETS`` request, for a route whose accepted requests set
server state by design) a good request (``GOOD``, a greedy two-token
``/generate``) must be answered with the output it had before the first
case: a case that leaves the server failing or changed is caught at the case
that did it. A case after which the server no longer serves ``GOOD`` stops
the run (``stopped``). Costs are bounded, not fuzzed: ``bound_cost`` caps
the token counts and fan-out fields of a body (``COST_CAPS``), as
``harness.request_fuzz`` draws no valid but expensive values.

``KNOWN`` lists findings not fixed yet, each with its reason: a case whose
route and outcome it names is reported as ``known``, never dropped.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import requests

GOOD = {
    "text": "page layer",
    "sampling_params": {"temperature": 0, "max_new_tokens": 2},
}

# Routes never called with generated data: each stops or reshapes the server
# by design, so what follows it would test the reshaped server, not the
# request (the fuzz calls every other route of /openapi.json).
EXCLUDED = {
    "/scale_elastic_ep": "resizes expert parallelism",
    "/start_profile": "starts the torch profiler: traces on disk, every forward slowed",
    "/release_memory_occupation": "frees the KV cache and weights: nothing is served until resumed",
    "/pause_generation": "stops scheduling until /continue_generation",
    "/slow_down": "sleeps in every forward by design (a test hook)",
    "/pd_role_switch": "switches the server's PD disaggregation role",
    "/update_weights_from_disk": "replaces the weights",
    "/update_weights_from_tensor": "replaces the weights",
    "/update_weights_from_distributed": "replaces the weights",
    "/update_weights_from_ipc": "replaces the weights",
    "/begin_weight_update": "starts a weight update",
    "/end_weight_update": "ends a weight update",
    "/update_weight_version": "changes the weight version the server reports",
    "/init_weights_update_group": "joins a weight-update process group",
    "/destroy_weights_update_group": "leaves a weight-update process group",
    "/init_weights_send_group_for_remote_instance": "joins a weight-send group",
    "/send_weights_to_remote_instance": "sends the weights to another instance",
}

# Routes whose accepted requests set server state by design: after each case
# the request that puts the start values back (0.5.23's defaults for the CPU
# server) is sent before the good request.
RESETS = {
    "/configure_logging": {
        "log_requests": False,
        "log_requests_level": 2,
        "log_requests_format": "text",
        "log_level": "info",
        "dump_requests_folder": "",
        "dump_requests_threshold": 1000,
        "dump_requests_exclude_meta_keys": [],
    },
}

# Findings not fixed yet: (method, path) -> (outcome, reason). A case with
# that route and outcome is reported as known (counted, listed with its
# reason by the benchmark), not as a finding; every other finding so far is
# fixed in the fixes group (fixes/0014-0022).
KNOWN: dict = {
    ("POST", "/api/chat"): (
        "5xx",
        "the Ollama route lets the chat template's ValueError for an empty "
        "messages list through (HTTP 500); not fixed yet",
    ),
    ("POST", "/v1/audio/transcriptions"): (
        "5xx",
        "on a model without audio input the transcription route fails inside "
        "its request adapter (\"Unexpected keyword argument '_detect_language'\", "
        "HTTP 500) instead of refusing the model; not fixed yet",
    ),
}

# Fields that cost real work when valid: capped, not fuzzed (load, not bad
# input). A cap keeps the field present with a value the schema accepts.
COST_CAPS = {
    "max_new_tokens": 4,
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "max_output_tokens": 4,
    "min_new_tokens": 4,
    "min_tokens": 4,
    "num_predict": 4,
    "n": 2,
    "best_of": 2,
    "top_logprobs_num": 8,
    "capacity_of_str_len": 4096,
}


# The fuzz server's context: a generation the case leaves unbounded (no
# max_tokens: up to the context) ends within it, so every case is short.
CONTEXT_LENGTH = 128


def server_args(admin_key: str) -> tuple:
    """The fuzz server's flags beyond the CPU server's."""
    return ("--admin-api-key", admin_key, "--context-length", str(CONTEXT_LENGTH))


def bound_cost(value):
    """``value`` with every ``COST_CAPS`` field that holds an int above its
    cap set to the cap, at any depth."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            cap = COST_CAPS.get(k)
            if cap is not None and type(v) is int and v > cap:
                v = cap
            out[k] = bound_cost(v)
        return out
    if isinstance(value, list):
        return [bound_cost(v) for v in value]
    return value


def admin_paths() -> set[str]:
    """Paths whose endpoint is marked ``ADMIN_OPTIONAL`` or ``ADMIN_FORCE``
    (``sglang.srt.utils.auth.auth_level``) in the installed server."""
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.utils.auth import AuthLevel

    admin = {AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE}
    return {
        route.path
        for route in app.routes
        if getattr(getattr(route, "endpoint", None), "_auth_level", None) in admin
    }


@dataclass
class Record:
    method: str
    path: str
    mode: str
    request: str  # the case as a curl command (no credentials)
    status: int | None  # the authenticated answer (or the only one)
    unauth_status: int | None = None  # the unauthenticated answer, admin key set
    s: float = 0.0
    outcome: str = "ok"  # ok | 5xx | timeout | auth | state | down | error
    detail: str = ""
    known: str = ""  # KNOWN's reason when the finding is listed there

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class Report:
    records: list = field(default_factory=list)
    stopped: str = ""  # the case after which the server stopped serving
    skipped: dict = field(default_factory=dict)  # operation -> why not called
    undrawable: dict = field(default_factory=dict)  # "op (mode)" -> the error
    seconds: float = 0.0

    def findings(self) -> list:
        return [r for r in self.records if r.outcome != "ok" and not r.known]

    def per_route(self) -> dict:
        """``{"METHOD path": Counter(outcome or status class)}``."""
        table: dict = {}
        for r in self.records:
            key = r.outcome if r.outcome != "ok" else f"{(r.status or 0) // 100}xx"
            table.setdefault(r.label, Counter())[key] += 1
        return table


def good_request(base_url: str, timeout: float):
    """The reference greedy ``/generate`` (``GOOD``): its output ids, or None
    and why it failed."""
    try:
        resp = requests.post(f"{base_url}/generate", json=GOOD, timeout=timeout)
    except requests.RequestException as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return None, f"{resp.status_code}: {resp.text[:300]}"
    body = resp.json()
    return (body["text"], tuple(body["output_ids"])), ""


def _send(case, base_url, headers, timeout):
    start = time.monotonic()
    try:
        resp = case.call(base_url=base_url, headers=headers, timeout=timeout)
        return resp.status_code, resp.text[:2000], time.monotonic() - start
    except requests.Timeout as exc:
        return None, f"timeout: {exc}", time.monotonic() - start
    except requests.RequestException as exc:
        return None, f"{type(exc).__name__}: {exc}", time.monotonic() - start


def _reset(base_url, path, headers, timeout):
    body = RESETS.get(path)
    if body is None:
        return
    resp = requests.post(
        f"{base_url}{path}", json=body, headers=headers, timeout=timeout
    )
    if resp.status_code != 200:
        raise AssertionError(f"reset of {path} answered {resp.status_code}")


def _case_runner(
    report, op, mode, base_url, admin_key, admin, auth, case_timeout, reference
):
    def one(case):
        try:
            _one(case)
        except Exception as exc:  # noqa: BLE001 - the harness's own failure
            report.records.append(
                Record(
                    method=op.method.upper(),
                    path=op.path,
                    mode=mode,
                    request=repr(case)[:2000],
                    status=None,
                    outcome="error",
                    detail=f"{type(exc).__name__}: {exc}",
                )
            )

    def _one(case):
        if report.stopped:
            return
        if isinstance(case.body, (dict, list)):
            case.body = bound_cost(case.body)
        if isinstance(case.query, dict):
            case.query = bound_cost(case.query)
        record = Record(
            method=op.method.upper(),
            path=op.path,
            mode=mode,
            request=case.as_curl_command(base_url=base_url),
            status=None,
        )
        guarded = admin_key is not None and op.path in admin
        if admin_key is not None:
            status, text, elapsed = _send(case, base_url, None, case_timeout)
            record.unauth_status = status
            if guarded and status != 401:
                record.outcome = "auth"
                record.detail = f"no key: {status} {text[:300]}"
            elif not guarded and status == 401:
                record.outcome = "auth"
                record.detail = "a non-admin route asked for the key"
            if not guarded:
                record.status, record.s = status, elapsed
                if status is None or status >= 500:
                    record.outcome = "timeout" if status is None else "5xx"
                    record.detail = text[:500]
        if guarded or admin_key is None:
            status, text, elapsed = _send(case, base_url, auth, case_timeout)
            record.status, record.s = status, elapsed
            if status is None:
                record.outcome, record.detail = "timeout", text[:500]
            elif status >= 500:
                record.outcome, record.detail = "5xx", text[:500]
            elif status == 401:
                record.outcome, record.detail = "auth", "the key was refused"
        _reset(base_url, op.path, auth, case_timeout)
        got, err = good_request(base_url, case_timeout)
        if got is None:
            record.outcome, record.detail = "down", err
            report.stopped = f"{record.label} ({mode}): {record.request}"
        elif got != reference and record.outcome == "ok":
            record.outcome = "state"
            record.detail = f"good request now {got}, was {reference}"
        known = KNOWN.get((record.method, record.path))
        if known and record.outcome == known[0]:
            record.known = known[1]
        report.records.append(record)

    return one


def run(
    base_url: str,
    *,
    seed: int,
    examples: int,
    modes=("positive", "negative"),
    admin_key: str | None = None,
    admin: set[str] | None = None,
    case_timeout: float = 30.0,
    only: set[str] | None = None,
    budget_s: float | None = None,
) -> Report:
    """Fuzz every operation of ``base_url``'s ``/openapi.json`` (``only``:
    these paths) with ``examples`` seeded cases per operation and mode;
    ``admin``: the admin paths (``admin_paths()``), needed with
    ``admin_key``. ``budget_s``: no new operation starts past it (each
    operation skipped then is listed in ``skipped``)."""
    from hypothesis import HealthCheck, Phase, given
    from hypothesis import seed as hypothesis_seed
    from hypothesis import settings
    from schemathesis import GenerationMode, openapi

    if admin_key is not None and admin is None:
        raise ValueError("admin_key needs the admin paths (admin_paths())")
    admin = admin or set()
    auth = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    spec = requests.get(f"{base_url}/openapi.json", timeout=30).json()
    schema = openapi.from_dict(spec)
    reference, err = good_request(base_url, case_timeout)
    if reference is None:
        raise AssertionError(f"the good request is not served before the fuzz: {err}")
    report = Report()
    start = time.monotonic()
    operations = []
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path in EXCLUDED:
            report.skipped[f"{op.method.upper()} {op.path}"] = EXCLUDED[op.path]
        elif only is None or op.path in only:
            operations.append(op)
    for op in operations:
        label = f"{op.method.upper()} {op.path}"
        if report.stopped:
            report.skipped[label] = f"the server stopped serving after {report.stopped}"
            continue
        if budget_s is not None and time.monotonic() - start > budget_s:
            report.skipped[label] = f"past the {budget_s:.0f} s budget"
            continue
        for mode in modes:
            if report.stopped:
                break
            strategy = op.as_strategy(generation_mode=GenerationMode(mode))
            one = _case_runner(
                report,
                op,
                mode,
                base_url,
                admin_key,
                admin,
                auth,
                case_timeout,
                reference,
            )
            test = settings(
                max_examples=examples,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
                derandomize=False,
            )(hypothesis_seed(seed)(given(case=strategy)(one)))
            try:
                test()
            except Exception as exc:  # noqa: BLE001 - a strategy that cannot draw
                # e.g. no negative case for an operation without parameters
                report.undrawable[f"{label} ({mode})"] = (
                    f"no case drawn: {type(exc).__name__}: {str(exc)[:200]}"
                )
    report.seconds = time.monotonic() - start
    return report


def table(report: Report) -> str:
    """A text table: per route, cases and outcomes (status classes for the
    cases that passed every check)."""
    rows = report.per_route()
    keys = ["2xx", "3xx", "4xx", "5xx", "timeout", "auth", "state", "down", "error"]
    width = max([len(k) for k in rows] + [5])
    lines = [f"{'route':<{width}} {'cases':>5} " + " ".join(f"{k:>7}" for k in keys)]
    for route in sorted(rows, key=lambda r: (r.split()[1], r.split()[0])):
        c = rows[route]
        lines.append(
            f"{route:<{width}} {sum(c.values()):>5} "
            + " ".join(f"{c.get(k, 0):>7}" for k in keys)
        )
    total = Counter()
    for c in rows.values():
        total.update(c)
    lines.append(
        f"{'all':<{width}} {sum(total.values()):>5} "
        + " ".join(f"{total.get(k, 0):>7}" for k in keys)
    )
    return "\n".join(lines)
