"""Each benchmark folder's README carries a results table generated from its
result JSON (benchmark/results_index.py); it must be current."""

import json
import re
import subprocess
import sys

from .conftest import ROOT


def test_results_tables_are_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "results_index.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    for feature in ("cache_aware_routing", "decode_hicache", "hicache_rank_shard"):
        results = ROOT / "benchmark" / feature / "results"
        assert results.is_dir()
        # One convention: every result file lies in a run folder named
        # <YYYYMMDDTHHMMZ>-<measurement>/.
        assert not [p.name for p in results.iterdir() if p.is_file()], feature
        for folder in results.iterdir():
            assert re.fullmatch(r"\d{8}T\d{4}Z-[a-z0-9][a-z0-9-]*", folder.name), folder
            assert list(folder.glob("*.json")), folder


def test_current_results_name_existing_runs():
    """Each benchmark README says which run is current for each measurement,
    above the generated table, naming run folders that exist."""
    for feature in ("cache_aware_routing", "decode_hicache", "hicache_rank_shard"):
        readme = (ROOT / "benchmark" / feature / "README.md").read_text()
        assert "## Current results" in readme, feature
        current = readme.split("## Current results", 1)[1].split(
            "<!-- results-table", 1
        )[0]
        named = set(re.findall(r"\(results/([^/)]+)/", current))
        assert named, feature
        for name in named:
            assert (ROOT / "benchmark" / feature / "results" / name).is_dir(), name


def _results_index():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "results_index", ROOT / "benchmark" / "results_index.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_folder_json_carries_revision_and_series_label():
    folders = [p for p in (ROOT / "benchmark").glob("*/results/*") if p.is_dir()]
    assert folders
    for folder in folders:
        readme = (folder.parents[1] / "README.md").read_text()
        assert f"[`{folder.name}`](results/{folder.name}/)" in readme, folder
        for path in folder.glob("*.json"):
            data = json.loads(path.read_text())
            assert data.get("git_revision"), path
            assert data.get("series_label"), path


def test_run_folder_row_has_key_figures(tmp_path):
    index = _results_index()
    run = tmp_path / "results" / "20261129T2326Z-h200x2-example"
    run.mkdir(parents=True)

    def record(mode, loads):
        return {
            "status": "ok",
            "gpu": "NVIDIA H200",
            "results": [
                {"mode": mode, "world": 2, "tokens": 99968, "load_event_ms": loads}
                for _ in range(2)
            ],
            "git_revision": "0" * 40,
            "series_label": "patched.0000abcd",
        }

    (run / "replicated.json").write_text(json.dumps(record("replicated", [9, 100])))
    (run / "sharded.json").write_text(json.dumps(record("sharded", [9, 55])))
    rows = index.folder_rows(tmp_path / "results")
    row = next(r for r in rows if "h200x2-example" in r)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "2026-11-29 23:26Z"  # from the folder's name
    assert cells[2:5] == ["00000000", "patched.0000abcd", "2× NVIDIA H200"]
    assert "replicated 100.0 ms; sharded 55.0 ms" in cells[5]
    assert "sharded / replicated **0.550**" in cells[5]
    assert cells[6] == "–"  # these records name no command


def test_no_two_result_images_are_the_same():
    # a run whose figure equals an earlier run's names that run in its README
    import hashlib

    seen = {}
    for image in sorted((ROOT / "benchmark").glob("*/results/*/*.png")):
        digest = hashlib.sha256(image.read_bytes()).hexdigest()
        rel = image.relative_to(ROOT)
        assert digest not in seen, f"{rel} is the same image as {seen[digest]}"
        seen[digest] = rel
