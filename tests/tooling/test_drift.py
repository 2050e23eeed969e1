"""make drift: how each patch applies to another release, without touching the series."""

import json
import shutil

from .conftest import ROOT, run_script


def test_drift_classifies_each_patch_on_a_moved_release(sandbox, tmp_path):
    tmp, env = sandbox
    pristine = next((ROOT / "build" / "upstream").glob("sglang-0.5.23-*"))
    release = tmp_path / "release"
    shutil.copytree(pristine, release, symlinks=True)
    # A "release" where one patched file moved by three lines and another is gone.
    dpc = release / "sglang/srt/managers/data_parallel_controller.py"
    dpc.write_text("# moved\n# by\n# three\n" + dpc.read_text())
    (release / "sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py").unlink()
    before = {p: p.read_bytes() for p in (tmp / "patches").rglob("*") if p.is_file()}
    out = tmp_path / "drift.json"
    proc = run_script(
        "drift.py", "0.5.99", "--tree", str(release), "--json", str(out), env=env
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    n_patches = sum(
        1
        for line in (tmp / "patches" / "series").read_text().splitlines()
        if line.split("#")[0].strip()
    )
    by_name = {r["patch"]: r for r in report["patches"]}
    routing = by_name[
        "cache-aware-routing/0003-dp-cache-aware-load-balance-method.patch"
    ]
    assert routing["status"] == "offset", routing
    assert any("offset 3 lines" in h for h in routing["hunks"])
    assembler = next(
        r for name, r in by_name.items() if name.startswith("hicache-rank-shard/0005")
    )
    assert assembler["status"] == "conflict"
    assert any("hybrid_pool_assembler.py" in h for h in assembler["hunks"])
    assert (
        by_name["cache-aware-routing/0001-dp-prefix-digest.patch"]["status"] == "clean"
    )
    assert sum(report["counts"].values()) == len(report["patches"]) == n_patches
    assert report["pinned"] is False
    assert "offset" in proc.stdout and "conflict" in proc.stdout
    # the series, the pin and the user's tree are untouched
    assert before == {
        p: p.read_bytes() for p in (tmp / "patches").rglob("*") if p.is_file()
    }
    assert not (tmp / "build" / "src").exists()
