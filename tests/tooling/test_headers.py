"""Patch headers: one template for every patch, the README's series table
generated from them, and PR.md paragraphs that are not cut at a prose line
that looks like a field."""

import re

from .conftest import ROOT, import_scripts, run_script

(headers,) = import_scripts("headers")


def test_every_patch_has_every_field():
    proc = run_script("headers.py", "check", env={})
    assert proc.returncode == 0, proc.stderr
    for name in headers.read_series():
        h = headers.patch_header((headers.PATCHES / name).read_text())
        assert not headers.missing_fields(h), name
        assert h["Upstream-Status"].startswith("not yet submitted"), name


def test_readme_series_table_is_current():
    proc = run_script("headers.py", "table", "--check", env={})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    readme = (ROOT / "docs" / "series.md").read_text()
    table = readme.split(headers.START)[1].split(headers.END)[0]
    rows = [l for l in table.splitlines() if re.match(r"\| \d+ \|", l)]
    assert len(rows) == len(headers.read_series())


def test_stale_table_is_reported():
    readme = (ROOT / "docs" / "series.md").read_text()
    stale = headers.readme_with_table(readme, "| Order |\n")
    assert stale != readme
    assert headers.readme_with_table(stale, headers.series_table()) == readme


def test_prose_line_like_a_field_stays_in_its_paragraph():
    text = (
        "Subject: [PATCH] [X] Do a thing\n\n"
        "Why: first words\nH-leaf: still the why\nmore.\n\n"
        "How: the how,\nNote: still the how.\n\n"
        "Upstream-Status: not yet submitted\nRelated: sgl-project/sglang#1\n"
        "Remove-When: upstream does it.\n\ndiff --git a/x b/x\n"
    )
    h = headers.patch_header(text)
    assert h["Subject"] == "[X] Do a thing"
    assert h["Why"].split() == "first words H-leaf: still the why more.".split()
    assert "Note: still the how." in h["How"]
    assert h["Related"] == "sgl-project/sglang#1"


def test_pr_md_carries_whole_paragraphs(built_prs):
    pr = (built_prs("decode-hicache") / "PR.md").read_text()
    for name in headers.read_series():
        if not name.startswith("decode-hicache/"):
            continue
        h = headers.patch_header((headers.PATCHES / name).read_text())
        for field in ("Why", "How"):
            assert f"- {h['Subject']}: {' '.join(h[field].split())}\n" in pr, name
    assert "Related:" in pr and "sgl-project/sglang#26560" in pr
