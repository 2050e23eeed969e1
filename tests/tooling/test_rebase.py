"""make rebase: carry the series to another release with git's 3-way merge,
stop at a conflict, continue after it, and write the carried series only over
committed files."""

import json
import re
import shutil
import subprocess

import pytest

from .conftest import ROOT, import_scripts, run_script

MOVED = "cache-aware-routing/0003-dp-cache-aware-load-balance-method.patch"
CONTEXT = "hicache-rank-shard/0001-l2-transfer-move-layer-loop-into-load-layer.patch"
CONFLICT = "decode-hicache/0005-decode-two-phase-l3-prefetch.patch"


def _git(repo, *args):
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout


def _first_hunk(patch_text):
    """(file, old start line, hunk lines) of the patch's first hunk."""
    path = re.search(r"(?m)^\+\+\+ b/(\S+)", patch_text).group(1)
    m = re.search(r"(?m)^@@ -(\d+),\d+ \+\d+(?:,\d+)? @@.*\n", patch_text)
    lines = patch_text[m.end() :].split("\n")
    return path, int(m.group(1)), lines


def _release(tmp_path, patches):
    """A copy of the pinned tree where one patched file moved by three lines,
    a context line of another patch's hunk changed (``patch --fuzz=0`` fails,
    a 3-way merge does not) and a line the last patch changes was changed
    differently (a real conflict)."""
    pristine = next((ROOT / "build" / "upstream").glob("sglang-0.5.23-*"))
    release = tmp_path / "release"
    shutil.copytree(pristine, release, symlinks=True)
    dpc = release / "sglang/srt/managers/data_parallel_controller.py"
    dpc.write_text("# moved\n# by\n# three\n" + dpc.read_text())
    path, start, _ = _first_hunk((patches / CONTEXT).read_text())
    target = release / path
    lines = target.read_text().split("\n")
    lines[start - 1] += "  # changed in the release"
    target.write_text("\n".join(lines))
    text = (patches / CONFLICT).read_text()
    path = re.search(r"(?m)^\+\+\+ b/(\S+)", text).group(1)
    target = release / path
    source = target.read_text()
    removed = [
        l[1:]
        for l in text.split("\n")
        if l.startswith("-") and not l.startswith("---") and l[1:].strip()
    ]
    line = next(l for l in removed if source.count(l + "\n") == 1)
    target.write_text(source.replace(line + "\n", line + "  # release\n"))
    return release, path


@pytest.fixture
def repo_sandbox(sandbox):
    """The sandbox with patches/ and a copy of the pin committed in git."""
    tmp, env = sandbox
    pin = tmp / "upstream" / "pin.toml"
    pin.parent.mkdir()
    shutil.copyfile(ROOT / "upstream" / "pin.toml", pin)
    _git(tmp, "init", "-q")
    _git(tmp, "add", "patches", "upstream")
    _git(
        tmp,
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "-qm",
        "series",
    )
    return tmp, {**env, "SGL_PIN_FILE": str(pin)}


def _files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_rebase_stops_at_the_conflict_and_carries_the_rest(repo_sandbox, tmp_path):
    tmp, env = repo_sandbox
    patches = tmp / "patches"
    release, conflict_file = _release(tmp_path, patches)
    pin_before = (tmp / "upstream" / "pin.toml").read_bytes()
    before = _files(patches)

    # Uncommitted work in patches/ is refused before anything happens.
    (patches / "series").write_text((patches / "series").read_text() + "\n")
    proc = run_script("rebase.py", "0.5.99", "--tree", str(release), env=env)
    assert proc.returncode == 2 and "uncommitted changes" in proc.stderr
    assert not (tmp / "build" / "rebase").exists()
    _git(tmp, "checkout", "--", "patches")

    proc = run_script("rebase.py", "0.5.99", "--tree", str(release), env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert CONFLICT in proc.stderr and conflict_file in proc.stderr
    assert "git cherry-pick --continue" in proc.stderr
    assert _files(patches) == before  # nothing written at a stop
    src = tmp / "build" / "rebase" / "src"
    # Another start while one is in progress is refused.
    again = run_script("rebase.py", "0.5.99", "--tree", str(release), env=env)
    assert again.returncode == 2 and "in progress" in again.stderr
    # Continuing before the conflict is resolved is refused.
    early = run_script("rebase.py", "--continue", env=env)
    assert early.returncode == 2 and "not finished" in early.stderr

    # Resolve: take the patch's side of the file, as a user would after editing.
    _git(src, "checkout", "--theirs", conflict_file)
    _git(src, "add", conflict_file)
    subprocess.run(
        ["git", "-C", str(src), "-c", "core.editor=true", "cherry-pick", "--continue"],
        capture_output=True,
        check=True,
        env={"GIT_AUTHOR_NAME": "t", "GIT_COMMITTER_NAME": "t", "EMAIL": "t@t"},
    )
    proc = run_script("rebase.py", "--continue", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp / "build" / "rebase" / "rebase-0.5.99.json").read_text())
    status = {r["patch"]: r["status"] for r in report["patches"]}
    assert status[MOVED] == "re-cut" and status[CONTEXT] == "re-cut"
    assert status[CONFLICT] == "resolved"
    assert set(status.values()) == {"unchanged", "re-cut", "resolved"}
    assert len(status) == len(before) - 1  # every series entry, not the series file

    # The carried series applies strictly to the release; the pin is kept
    # (no wheel to pin from a tree); unchanged patches kept their bytes.
    assert (tmp / "upstream" / "pin.toml").read_bytes() == pin_before
    for name, st in status.items():
        same = (patches / name).read_bytes() == before[patches / name]
        assert same == (st == "unchanged"), name
    fresh = tmp_path / "check"
    shutil.copytree(release, fresh, symlinks=True)
    run_script("series.py", "check-patch", str(fresh), env=env, check=True)
    assert "patches/" in _git(tmp, "status", "--porcelain")  # undo: git checkout


def test_survey_reports_without_writing(repo_sandbox, tmp_path):
    tmp, env = repo_sandbox
    patches = tmp / "patches"
    release, conflict_file = _release(tmp_path, patches)
    before = _files(patches)
    proc = run_script(
        "rebase.py", "0.5.99", "--tree", str(release), "--survey", env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp / "build" / "rebase" / "rebase-0.5.99.json").read_text())
    rows = {r["patch"]: r for r in report["patches"]}
    assert rows[CONFLICT]["status"] == "conflict"
    assert rows[CONFLICT]["files"] == [conflict_file]
    assert rows[MOVED]["status"] == rows[CONTEXT]["status"] == "re-cut"
    assert _files(patches) == before
    assert not (tmp / "build" / "rebase" / "state.json").exists()


def test_pin_for_the_new_release_loads(tmp_path):
    rebase, upstream = import_scripts("rebase", "upstream")
    wheel = tmp_path / "sglang-0.5.99-cp312-cp312-manylinux_2_34_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    pin_file = tmp_path / "pin.toml"
    pin_file.write_text(rebase.pin_text("0.5.99", wheel))
    pin = upstream.load_pin(pin_file)
    assert pin.version == "0.5.99"
    assert pin.wheels[wheel.name]["size"] == wheel.stat().st_size
    assert pin.wheels[wheel.name]["sha256"] == upstream.sha256_of(wheel)
