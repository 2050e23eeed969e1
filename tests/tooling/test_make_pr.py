"""make pr: PR.md in upstream's template with benchmark tables read from the
committed JSON, and a configurable author for the extracted patches."""

import json

from .conftest import ROOT, run_script


def test_pr_md_benchmark_tables_come_from_the_committed_json(sandbox):
    tmp, env = sandbox
    proc = run_script(
        "make_pr.py",
        "cache-aware-routing",
        env={**env, "PR_AUTHOR": "Jane Doe <jane@example.com>"},
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp / "build" / "pr" / "cache-aware-routing"
    pr = (out / "PR.md").read_text()
    for section in (
        "## Motivation",
        "## Modifications",
        "## Accuracy Tests",
        "## Benchmarking and Profiling",
        "## Checklist",
    ):
        assert section in pr
    assert "See the series README" not in pr
    results = ROOT / "benchmark" / "cache_aware_routing" / "results"
    live = sorted(results.glob("bench_live_routing_full_*.json"))[-1]
    data = json.loads(live.read_text())
    assert str(live.relative_to(ROOT)) in pr
    for run in data["runs"]:
        s = run["summary"]
        split = "/".join(str(n) for n in s["requests_per_rank"])
        row = f"| {run['mode']} | {run['policy']} | {s['hit_rate']:.3f} |"
        assert row in pr and split in pr, row
    assert "#26066" in pr  # the routing motivation answers upstream's position
    for patch in out.glob("*.patch"):
        assert patch.read_text().splitlines()[1] == "From: Jane Doe <jane@example.com>"


def test_bad_author_is_refused_before_writing(sandbox):
    tmp, env = sandbox
    proc = run_script(
        "make_pr.py", "decode-hicache", env={**env, "PR_AUTHOR": "no email"}
    )
    assert proc.returncode == 2 and "PR_AUTHOR" in proc.stderr
    assert not (tmp / "build" / "pr" / "decode-hicache").exists()


def test_every_group_gets_a_benchmark_section(sandbox):
    tmp, env = sandbox
    for group in ("hicache-rank-shard", "decode-hicache"):
        proc = run_script("make_pr.py", group, env=env)
        assert proc.returncode == 0, proc.stderr
        pr = (tmp / "build" / "pr" / group / "PR.md").read_text()
        bench = pr.split("## Benchmarking and Profiling")[1].split("## Checklist")[0]
        assert "results/" in bench and "|---|" in bench, group
