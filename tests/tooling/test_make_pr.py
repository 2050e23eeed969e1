"""make pr: PR.md in upstream's template with benchmark tables read from the
committed JSON, and a configurable author for the extracted patches."""

import json
import sys

import pytest

from .conftest import PR_AUTHOR, ROOT, import_scripts, run_script

sys.path.insert(0, str(ROOT / "scripts"))
from common import ToolError, group_needs  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


def test_pr_md_benchmark_tables_come_from_the_committed_json(built_prs):
    out = built_prs("cache-aware-routing")
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
    live = sorted(results.glob("*-live-routing/bench_live_routing.json"))[-1]
    data = json.loads(live.read_text())
    assert str(live.relative_to(ROOT)) in pr
    for run in data["runs"]:
        s = run["summary"]
        split = "/".join(str(n) for n in s["requests_per_rank"])
        row = f"| {run['mode']} | {run['policy']} | {s['hit_rate']:.3f} |"
        assert row in pr and split in pr, row
    assert "#26066" in pr  # the routing motivation answers upstream's position
    for patch in out.glob("*.patch"):
        assert patch.read_text().splitlines()[1] == f"From: {PR_AUTHOR}"


def test_bad_author_is_refused_before_writing(sandbox):
    tmp, env = sandbox
    proc = run_script(
        "make_pr.py", "decode-hicache", env={**env, "PR_AUTHOR": "no email"}
    )
    assert proc.returncode == 2 and "PR_AUTHOR" in proc.stderr
    assert not (tmp / "build" / "pr" / "decode-hicache").exists()


def test_every_group_gets_a_benchmark_section(built_prs):
    for group in ("hicache-rank-shard", "decode-hicache"):
        pr = (built_prs(group) / "PR.md").read_text()
        bench = pr.split("## Benchmarking and Profiling")[1].split("## Checklist")[0]
        assert "results/" in bench and "|---|" in bench, group


def _apply_alone(tmp_path, patches):
    """patch -p1 --fuzz=0 each file onto pristine under python/; outputs."""
    import shutil
    import subprocess

    pristine = next((ROOT / "build" / "upstream").glob("sglang-0.5.23-*"))
    tree = tmp_path / "alone"
    shutil.copytree(pristine / "sglang", tree / "python" / "sglang", symlinks=True)
    outputs = []
    for patch in patches:
        proc = subprocess.run(
            ["patch", "-p1", "--fuzz=0", "--batch", "-i", str(patch)],
            cwd=tree,
            capture_output=True,
            text=True,
            env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"},
        )
        outputs.append((proc.returncode, proc.stdout + proc.stderr))
    return outputs


def test_the_fixes_pr_ticks_benchmark_results_with_its_malformed_mix_table(
    built_prs,
):
    pr = (built_prs("fixes") / "PR.md").read_text()
    results = ROOT / "benchmark" / "reliability" / "results"
    mix = sorted(results.glob("*-malformed-mix/bench_malformed_mix.json"))[-1]
    data = json.loads(mix.read_text())
    assert str(mix.relative_to(ROOT)) in pr
    for mode, s in data["pooled"].items():
        row = f"| {mode} | {s['good_200']}/{s['good']} | {s['bad_4xx']}/{s['bad']} |"
        assert row in pr, row
    assert "- [x] Provide accuracy and speed benchmark results" in pr


def test_each_group_applies_alone_at_its_recorded_lines(built_prs, tmp_path):
    for group in ("hicache-rank-shard", "cache-aware-routing", "decode-hicache"):
        out = built_prs(group)
        patches = sorted(out.glob("*.patch"))
        assert patches
        # a group stacked on fixes (its series "# needs:") gets them first
        stacked = sorted((out / "stacked-on").glob("*.patch"))
        assert [p.name for p in stacked] == [
            n.split("/")[1] for n in group_needs(group)
        ]
        for code, output in _apply_alone(tmp_path / group, stacked + patches):
            assert code == 0 and "offset" not in output and "fuzz" not in output, (
                group,
                output,
            )


def test_decode_hicache_needs_the_fixes_it_builds_on(built_prs, tmp_path):
    # Negative control of the stacking: without the fixes it builds on (the
    # host-span lock; the restored prefix's cached-token split, whose storage
    # line the two-phase L3 prefetch extends), the decode group does not apply
    # to pristine 0.5.23.
    assert group_needs("decode-hicache") == [
        "fixes/0005-lock-the-host-backed-span-of-a-decode-prefix-match-u.patch",
        "fixes/0008-count-a-pd-decode-prefix-restored-from-host-as-host.patch",
    ]
    patches = sorted(built_prs("decode-hicache").glob("*.patch"))
    outputs = _apply_alone(tmp_path, patches)
    assert any(code != 0 for code, _ in outputs), outputs


def test_a_need_outside_the_series_is_refused(tmp_path):
    series = tmp_path / "series"
    series.write_text(
        "# == fixes: x ==\nfixes/0001-a.patch\n"
        "# == feat: y ==\n# needs: fixes/0002-missing.patch\nfeat/0001-b.patch\n"
    )
    assert group_needs("fixes", series) == []
    with pytest.raises(ToolError, match="needs fixes/0002-missing.patch"):
        group_needs("feat", series)


DEPENDENT = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: SGLang patch series <sglang-patches@users.noreply.github.com>
Date: Thu, 1 Jan 2026 00:00:00 +0000
Subject: [PATCH] [PD] Append a field after the routing fields

Why: a test patch whose context is another group's lines.

How: one field appended after cache-aware-routing's.

Upstream-Status: not yet submitted
Related: none
Remove-When: never.
---
diff --git a/sglang/srt/arg_groups/field_order.py b/sglang/srt/arg_groups/field_order.py
--- a/sglang/srt/arg_groups/field_order.py
+++ b/sglang/srt/arg_groups/field_order.py
@@ -557,5 +557,6 @@ POSITIONAL_FIELD_ORDER = (
     "dp_routing_digest_max_age",
     "dp_routing_digest_publish_interval",
     "dp_routing_pending_ttl",
+    "test_dependent_field",
 )
 # fmt: on
"""


def test_a_group_using_another_groups_lines_is_refused(sandbox):
    tmp, env = sandbox
    name = "decode-hicache/0007-append-a-field-after-the-routing-fields.patch"
    (tmp / "patches" / name).write_text(DEPENDENT)
    series = tmp / "patches" / "series"
    series.write_text(series.read_text() + name + "\n")
    proc = run_script("make_pr.py", "decode-hicache", env=env)
    assert proc.returncode == 2, proc.stdout
    assert name in proc.stderr and "field_order.py" in proc.stderr
    assert "without the groups before it" in proc.stderr


def test_every_registered_test_declares_exactly_one_group():
    pr_tests, common = import_scripts("pr_tests", "common")
    read_series = common.read_series
    groups = {name.split("/")[0] for name in read_series()}
    files = pr_tests.registered_tests()
    assert files
    seen = set()
    for path in files:
        declared = pr_tests.declared_groups(path)
        assert len(declared) == 1, (path, declared)
        assert declared[0] in groups | {pr_tests.SERIES_WIDE}, (path, declared)
        seen.add(declared[0])
        suite = pr_tests.cpu_registration(path).get("suite")
        assert suite in pr_tests.UPSTREAM_CPU_SUITES, (path, suite)
    assert groups <= seen  # every group has tests
    for group in groups:  # ... and some of them go upstream with its PR
        assert pr_tests.feature_tests(group), group
    routing = {p.name for p in pr_tests.feature_tests("cache-aware-routing")}
    assert "test_cache_aware_dispatch.py" in routing
    # Comparisons with unpatched upstream and series-wide tests stay here.
    assert "test_load_balance_flag_off.py" not in routing
    assert pr_tests.project_only(
        ROOT / "tests/registered/unit/managers/test_load_balance_flag_off.py"
    )
    assert "test_drop_in_server.py" not in routing
