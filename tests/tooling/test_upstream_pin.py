"""The pin: only the pinned, byte-identical upstream wheel is accepted."""

import shutil
import zipfile

from .conftest import run_script


def test_pinned_wheel_verifies(upstream_wheel, sandbox):
    _, env = sandbox
    proc = run_script("upstream.py", "verify", "--wheel", str(upstream_wheel), env=env)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip()) == 64


def test_tampered_wheel_refused(upstream_wheel, sandbox):
    tmp, env = sandbox
    bad = tmp / upstream_wheel.name
    shutil.copy(upstream_wheel, bad)
    with open(bad, "r+b") as f:  # flip one byte in the middle of the archive
        f.seek(bad.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = run_script("upstream.py", "unpack", "--wheel", str(bad), env=env)
    assert proc.returncode == 2
    assert "does not match the pinned sha256" in proc.stderr
    assert not (tmp / "build" / "upstream").exists()  # nothing was unpacked


def test_missing_wheel_refused(upstream_wheel, sandbox):
    tmp, env = sandbox
    proc = run_script(
        "upstream.py", "unpack", "--wheel", str(tmp / upstream_wheel.name), env=env
    )
    assert proc.returncode == 2
    assert "upstream wheel not found" in proc.stderr


def test_missing_pin_refused(sandbox):
    tmp, env = sandbox
    proc = run_script(
        "upstream.py", "unpack", env={**env, "SGL_PIN_FILE": str(tmp / "nope.toml")}
    )
    assert proc.returncode == 2
    assert "missing pin file" in proc.stderr


def test_unpinned_target_refused(sandbox):
    _, env = sandbox
    proc = run_script("upstream.py", "unpack", "--python-tag", "cp310", env=env)
    assert proc.returncode == 2
    assert "no pinned sglang 0.5.23 wheel for cp310" in proc.stderr


def test_version_mismatch_refused(sandbox):
    """A wheel whose hash matches its pin entry but whose METADATA names another
    version is refused at unpack."""
    import hashlib

    tmp, env = sandbox
    name = "sglang-0.5.99-cp311-cp311-manylinux_2_34_x86_64.whl"
    fake = tmp / name
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(
            "sglang-0.5.99.dist-info/METADATA", "Name: sglang\nVersion: 0.5.23\n\n"
        )
        zf.writestr("sglang/_version.py", "__version__ = version = '0.5.23'\n")
    digest = hashlib.sha256(fake.read_bytes()).hexdigest()
    pin = tmp / "pin.toml"
    pin.write_text(
        'name = "sglang"\nversion = "0.5.99"\n'
        f'[wheels."{name}"]\nsha256 = "{digest}"\nsize = {fake.stat().st_size}\n'
    )
    proc = run_script(
        "upstream.py",
        "unpack",
        "--wheel",
        str(fake),
        "--pin",
        str(pin),
        "--python-tag",
        "cp311",
        "--platform",
        "manylinux_2_34_x86_64",
        env={**env, "SGL_UPSTREAM_DIR": str(tmp / "trees")},
    )
    assert proc.returncode == 2
    assert "wheel METADATA says sglang 0.5.23, pin says sglang 0.5.99" in proc.stderr
    assert not any((tmp / "trees").glob("sglang-*"))


def test_user_supplied_wheel_errors_name_their_source(upstream_wheel, sandbox):
    tmp, env = sandbox
    wrong = tmp / "sglang-0.5.23-cp39-cp39-linux_x86_64.whl"
    shutil.copy(upstream_wheel, wrong)
    proc = run_script(
        "upstream.py", "unpack", env={**env, "UPSTREAM_WHEEL": str(wrong)}
    )
    assert proc.returncode == 2
    assert "UPSTREAM_WHEEL sglang-0.5.23-cp39" in proc.stderr
    assert "--wheel" not in proc.stderr
    bad = tmp / upstream_wheel.name
    shutil.copy(upstream_wheel, bad)
    with open(bad, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = run_script("upstream.py", "unpack", env={**env, "UPSTREAM_WHEEL": str(bad)})
    assert proc.returncode == 2
    assert "(from UPSTREAM_WHEEL)" in proc.stderr
    # A user's file is not the download cache: no advice to delete it.
    assert "Delete it" not in proc.stderr and "Give UPSTREAM_WHEEL" in proc.stderr
    proc = run_script("upstream.py", "unpack", "--wheel", str(bad), env=env)
    assert proc.returncode == 2 and "Give --wheel the pinned wheel" in proc.stderr
