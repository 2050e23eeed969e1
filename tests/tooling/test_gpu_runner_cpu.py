"""The GPU runner (``python -m benchmark.hicache_rank_shard.gpu_tp_run``) on
CPU: two gloo ranks load a small sharded prefix back through the patched path,
bit-exact, and the JSON records the command, the git revision and the series
label. GPU time
is scarce; this is what keeps the runner working between GPU sessions."""

import json
import subprocess
import sys

from .conftest import ROOT


def test_gpu_runner_runs_on_cpu_ranks(tmp_path):
    out = tmp_path / "sharded.json"
    proc = subprocess.run(
        [
            sys.executable,
            *("-m", "benchmark.hicache_rank_shard.gpu_tp_run"),
            *("--mode", "sharded", "--tokens", "512", "--layers", "4"),
            *("--iters", "2", "--world", "2", "--device", "cpu"),
            *("--timeout", "600", "--out", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["status"] == "ok", record["status"]
    assert len(record["results"]) == 2
    for rank in record["results"]:
        assert rank["sharded"] and rank["restore_mismatches"] == 0, rank
    assert record["git_revision"] and record["series_label"]
    assert record["command"].split()[1:3] == [
        "-m",
        "benchmark.hicache_rank_shard.gpu_tp_run",
    ], record["command"]
