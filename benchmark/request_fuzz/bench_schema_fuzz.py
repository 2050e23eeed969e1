"""Every route of a live CPU server's ``/openapi.json``, fuzzed from its schema.

One ``sglang serve`` of the installed wheel (``harness.live_server``: the tiny
Llama on CPU, 127.0.0.1 only) with ``--admin-api-key`` gets
``harness.schema_fuzz.run``: ``--examples`` seeded schemathesis cases per
operation and generation mode (positive: what the schema accepts, negative:
what it refuses), each sent without the key (an admin route must answer
401) and, on an admin route, with it; no answer may be a 5xx or take longer
than ``--case-timeout``, and after each case a greedy ``/generate`` must
still give its first output. The routes ``schema_fuzz.EXCLUDED`` lists (they
stop or reshape the server by design) are not called.

Prints a table of cases per route and outcome (status class of the cases
that passed, else the finding), lists every finding with its request, and
writes ``results/<run>/bench_schema_fuzz.json`` (run metadata: git
revision, series label, machine; the parameters, the table, every case).
Exits 1 on a finding not listed in ``schema_fuzz.KNOWN``.

Run: ``.venv/bin/python -m benchmark.request_fuzz.bench_schema_fuzz``
(``--examples 25``: about 15-20 min on 2 cores; ``--quick``: 2 per
operation and mode).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmark.bench_meta import run_dir, run_metadata
from harness import schema_fuzz
from harness.live_server import LiveServer, assert_all_gone

ROOT = Path(__file__).resolve().parent.parent.parent
ADMIN_KEY = "schema-fuzz-admin-key"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=25)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--case-timeout", type=float, default=30.0)
    ap.add_argument("--only", nargs="*", help="fuzz only these paths")
    ap.add_argument("--quick", action="store_true", help="--examples 2")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    if args.quick:
        args.examples = 2
    t0 = time.perf_counter()
    series = importlib.metadata.version("sglang")
    admin = schema_fuzz.admin_paths()
    server = LiveServer(
        "patched", list(schema_fuzz.server_args(ADMIN_KEY)), name="schema-fuzz-bench"
    )
    try:
        report = schema_fuzz.run(
            server.base_url,
            seed=args.seed,
            examples=args.examples,
            admin_key=ADMIN_KEY,
            admin=admin,
            case_timeout=args.case_timeout,
            only=set(args.only) if args.only else None,
        )
        alive = schema_fuzz.good_request(server.base_url, 30)[0] is not None
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        assert_all_gone(server.stop())
    print(f"\n{series}: seed {args.seed}, {args.examples} cases per operation and mode")
    print(schema_fuzz.table(report))
    findings = report.findings()
    known = [r for r in report.records if r.known]
    for r in findings + known:
        tag = f"known: {r.known}" if r.known else "FINDING"
        print(f"\n{tag}: {r.label} ({r.mode}) {r.outcome} {r.status}: {r.detail[:300]}")
        print(f"  {r.request[:600]}")
    if report.stopped:
        print(f"\nthe server stopped serving after {report.stopped}")
    print(f"\n{len(report.records)} cases in {report.seconds:.0f} s; not called:")
    for label, why in sorted(report.skipped.items()):
        print(f"  {label}: {why}")
    meta = {
        **run_metadata(),
        "series": series,
        "params": {
            "examples": args.examples,
            "seed": args.seed,
            "case_timeout_s": args.case_timeout,
            "modes": ["positive", "negative"],
            "model": "tiny-llama",
            "server_args": [
                "--admin-api-key",
                "<key>",
                "--context-length",
                str(schema_fuzz.CONTEXT_LENGTH),
            ],
            "only": args.only,
            "schemathesis": importlib.metadata.version("schemathesis"),
            "hypothesis": importlib.metadata.version("hypothesis"),
        },
        "wall_s": time.perf_counter() - t0,
        "fuzz_s": report.seconds,
        "server_alive_after": alive,
        "stopped": report.stopped,
        "not_called": report.skipped,
        "per_route": {k: dict(v) for k, v in report.per_route().items()},
        "findings": len(findings),
        "known": len(known),
        "records": [asdict(r) for r in report.records],
    }
    path = run_dir(args.out, "schema-fuzz" + ("-quick" if args.quick else ""))
    path = path / "bench_schema_fuzz.json"
    path.write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"\nwrote {shown}")
    if findings or report.stopped or not alive:
        sys.exit(f"{len(findings)} finding(s); stopped: {report.stopped or 'no'}")


if __name__ == "__main__":
    main()
