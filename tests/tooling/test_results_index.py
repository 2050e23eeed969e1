"""Each benchmark folder's README carries a results table generated from its
result JSON (benchmark/results_index.py); it must be current."""

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
        readme = (ROOT / "benchmark" / feature / "README.md").read_text()
        results = sorted((ROOT / "benchmark" / feature / "results").glob("*.json"))
        assert results
        for path in results:
            assert f"(results/{path.name})" in readme, path.name
