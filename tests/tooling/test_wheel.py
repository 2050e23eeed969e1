"""make wheel: upstream tags, local version everywhere, valid RECORD, pip picks it."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from .conftest import ROOT, run_script, sandbox_env

TOOLS_PY = ROOT / "build" / "tools" / "bin" / "python"


@pytest.fixture(scope="module")
def built(tmp_path_factory, upstream_wheel):
    tmp = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, **sandbox_env(tmp, upstream_wheel), "LABEL": "test.7"}
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/series.py"), "apply"], env=env, check=True
    )
    python = str(TOOLS_PY) if TOOLS_PY.exists() else sys.executable
    proc = subprocess.run(
        [python, str(ROOT / "scripts/build_wheel.py")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    wheels = list((tmp / "dist").glob("*.whl"))
    assert len(wheels) == 1
    return tmp, wheels[0], proc.stdout, upstream_wheel


def test_name_tags_and_version(built):
    _, wheel, out, upstream_wheel = built
    tags = upstream_wheel.name.split("-", 2)[2]
    assert wheel.name == f"sglang-0.5.23+test.7-{tags}"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read("sglang-0.5.23+test.7.dist-info/METADATA").decode()
        wheel_file = zf.read("sglang-0.5.23+test.7.dist-info/WHEEL").decode()
        version_py = zf.read("sglang/_version.py").decode()
        series = zf.read("sglang-0.5.23+test.7.dist-info/PATCH_SERIES").decode()
    assert "Version: 0.5.23+test.7\n" in meta
    assert f"Tag: {tags[:-4]}" in wheel_file and "Root-Is-Purelib: false" in wheel_file
    assert "__version__ = version = '0.5.23+test.7'" in version_py
    assert "__version_tuple__ = version_tuple = (0, 5, 23, 'test.7')" in version_py
    assert not any(n.startswith("sglang-0.5.23.dist-info/") for n in names)
    assert series == (ROOT / "patches" / "series").read_text()
    # the patched-file list is printed
    assert "patched files" in out and "sglang/srt/mem_cache/l2_transfer.py" in out


def test_record_is_valid_and_contents_are_the_patched_tree(built):
    tmp, wheel, _, upstream_wheel = built
    from wheel.wheelfile import WheelFile  # validates every RECORD hash on read

    with WheelFile(wheel) as wf:
        for info in wf.infolist():
            wf.read(info.filename)
    with zipfile.ZipFile(wheel) as ours, zipfile.ZipFile(upstream_wheel) as theirs:
        # files only: the upstream zip also lists directory entries
        a = {n for n in ours.namelist() if ".dist-info/" not in n and n[-1] != "/"}
        b = {n for n in theirs.namelist() if ".dist-info/" not in n and n[-1] != "/"}
        src = tmp / "build" / "src"
        status = subprocess.run(
            ["git", "-C", str(src), "diff", "--name-status", "upstream", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        added = {l.split("\t")[1] for l in status if l.startswith("A\t")}
        deleted = {l.split("\t")[1] for l in status if l.startswith("D\t")}
        assert a == (b | added) - deleted
        for name in sorted(a):
            if name.endswith("l2_transfer.py") or name.endswith(".so"):
                assert ours.read(name) == (src / name).read_bytes(), name
        so = [n for n in a if n.endswith(".so")]
        assert so and all(ours.read(n) == theirs.read(n) for n in so)


def _scratch_venv(tmp: Path) -> Path:
    venv = tmp / "scratch-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    return venv / "bin" / "python"


def test_installs_reports_label_and_pip_prefers_it(built):
    tmp, wheel, _, upstream_wheel = built
    py = _scratch_venv(tmp)
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
    )
    # sglang's import needs torch & co: borrow this test venv's site-packages
    # *after* the scratch venv's own, so the scratch sglang is the one imported;
    # addsitedir also runs that venv's .pth hooks (the torchvision stand-in).
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    borrowed = sysconfig.get_paths()["purelib"]
    Path(site, "zz_test_deps.pth").write_text(
        f"import site; site.addsitedir({borrowed!r})\n"
    )
    proc = subprocess.run(
        [py, "-c", "import sglang; print(sglang.__version__); print(sglang.__file__)"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, location = proc.stdout.split()[-2:]
    assert version == "0.5.23+test.7"
    assert location.startswith(site)

    # pip resolves `sglang==0.5.23` to the local-label wheel, also when the
    # upstream wheel is offered next to it.
    links = tmp / "links"
    links.mkdir()
    shutil.copy(wheel, links)
    shutil.copy(upstream_wheel, links)
    report = tmp / "report.json"
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(links),
            "--report",
            str(report),
            "sglang==0.5.23",
        ],
        check=True,
    )
    chosen = json.loads(report.read_text())["install"]
    assert [c["metadata"]["version"] for c in chosen] == ["0.5.23+test.7"]


def test_bad_label_refused(built):
    tmp, _, _, upstream_wheel = built
    env = {
        "SGL_BUILD_DIR": str(tmp / "build"),
        "SGL_PATCHES_DIR": str(tmp / "patches"),
        "SGL_DIST_DIR": str(tmp / "dist2"),
        "LABEL": "bad-label!",
    }
    proc = run_script("build_wheel.py", env=env)
    assert proc.returncode == 2 and "invalid local version label" in proc.stderr
    assert not (tmp / "dist2").exists() or not any((tmp / "dist2").iterdir())


def _build(tmp, dist, extra=None):
    env = {
        **os.environ,
        "SGL_BUILD_DIR": str(tmp / "build"),
        "SGL_PATCHES_DIR": str(tmp / "patches"),
        "SGL_DIST_DIR": str(tmp / dist),
        "LABEL": "test.7",
        **(extra or {}),
    }
    python = str(TOOLS_PY) if TOOLS_PY.exists() else sys.executable
    return subprocess.run(
        [python, str(ROOT / "scripts/build_wheel.py")],
        env=env,
        capture_output=True,
        text=True,
    )


def _sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_rebuild_is_byte_identical_and_skipped_when_unchanged(built):
    tmp, wheel, _, _ = built
    first = _sha(wheel)
    proc = _build(tmp, "dist")  # same tree, label and dist: not repacked
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout
    assert _sha(wheel) == first
    proc = _build(tmp, "dist-again")  # packed again elsewhere: the same bytes
    assert proc.returncode == 0, proc.stderr
    (again,) = (tmp / "dist-again").glob("*.whl")
    assert again.name == wheel.name and _sha(again) == first
    # SOURCE_DATE_EPOCH is honoured (zip timestamps), so it changes the bytes.
    proc = _build(tmp, "dist-epoch", {"SOURCE_DATE_EPOCH": "1800000000"})
    assert proc.returncode == 0, proc.stderr
    (other,) = (tmp / "dist-epoch").glob("*.whl")
    assert _sha(other) != first


def test_amended_unexported_commit_refused(built):
    # The label names the series: a tree whose commits differ from the patch
    # files (amended, not refreshed) must not be packed under it.
    tmp, _, _, _ = built
    src = tmp / "build" / "src"

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
            + list(args),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    head = git("rev-parse", "HEAD")
    try:
        git("commit", "-q", "--amend", "-m", "[PD] amended, not exported")
        proc = _build(tmp, "dist-amended")
        assert proc.returncode == 2
        assert "differs from patches/" in proc.stderr and "make refresh" in proc.stderr
        assert not list((tmp / "dist-amended").glob("*.whl"))
    finally:
        git("reset", "-q", "--hard", head)
