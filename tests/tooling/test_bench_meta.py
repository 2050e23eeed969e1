"""bench_meta: which revision a benchmark's JSON records. On the GPU host the
copy's .git may be older than its files, so SGL_BENCH_BUNDLED=1 reads the
bundle's record instead; here, git."""

import json
import subprocess
import sys

import pytest

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmark"))
import bench_meta  # noqa: E402

sys.path.remove(str(ROOT / "benchmark"))


def test_bundled_record_only_where_asked(tmp_path, monkeypatch):
    record = tmp_path / "revision.json"
    record.write_text(json.dumps({"git_revision": "f" * 40, "series_label": "x.1"}))
    monkeypatch.setattr(bench_meta, "BUNDLED", record)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    monkeypatch.delenv("SGL_BENCH_BUNDLED", raising=False)
    assert bench_meta.git_revision() == head
    monkeypatch.setenv("SGL_BENCH_BUNDLED", "1")
    assert bench_meta.git_revision() == "f" * 40
    assert bench_meta.series_label() == "x.1"
    record.unlink()
    with pytest.raises(RuntimeError, match="SGL_BENCH_BUNDLED=1 but"):
        bench_meta.git_revision()


def test_run_dir_is_one_folder_per_run(tmp_path):
    import re

    path = bench_meta.run_dir(tmp_path / "results", "routing-quick")
    assert path.is_dir() and path.parent == tmp_path / "results"
    assert re.fullmatch(r"\d{8}T\d{4}Z-routing-quick", path.name), path.name


def test_one_percentile_interpolates_between_ranks():
    assert bench_meta.percentile([], 50) is None
    assert bench_meta.percentile([3.0], 99) == 3.0
    assert bench_meta.percentile([4, 1, 3, 2], 50) == 2.5
    assert bench_meta.percentile(range(101), 90) == 90
    assert bench_meta.percentile([0, 10], 99) == 9.9
