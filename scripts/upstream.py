#!/usr/bin/env python3
"""Fetch, verify and unpack the pinned upstream SGLang wheel.

    python scripts/upstream.py unpack [--python-tag cp312] [--platform manylinux_2_34_aarch64]
                                      [--wheel PATH]

Prints the path of the unpacked pristine tree (build/upstream/<wheel stem>/).
The wheel comes from --wheel (or $UPSTREAM_WHEEL), else from the download cache
build/cache/, else from PyPI through ``pip download``.  Whatever its source, a
wheel whose name is not pinned, or whose size or sha256 differ from the pin, is
refused; so is a wheel whose METADATA or ``_version.py`` names another version.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common import CACHE, PIN, UPSTREAM_TREES, ToolError, run_main

STAMP = ".upstream-wheel"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    wheels: dict  # filename -> {"sha256": ..., "size": ...}


def load_pin(path: Path = PIN) -> Pin:
    if not path.is_file():
        raise ToolError(
            f"missing pin file {path}: the series cannot be built without the "
            "pinned upstream version and wheel hashes"
        )
    try:
        data = tomllib.loads(path.read_text())
        pin = Pin(data["name"], data["version"], dict(data["wheels"]))
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise ToolError(f"invalid pin file {path}: {exc}") from exc
    for fname, meta in pin.wheels.items():
        if not re.fullmatch(r"[0-9a-f]{64}", str(meta.get("sha256", ""))):
            raise ToolError(f"pin file {path}: {fname} has no valid sha256")
        if not fname.startswith(f"{pin.name}-{pin.version}-"):
            raise ToolError(
                f"pin file {path}: wheel {fname} does not belong to "
                f"{pin.name} {pin.version}"
            )
    return pin


def default_python_tag() -> str:
    return os.environ.get("PYTHON_TAG") or "cp{}{}".format(*sys.version_info[:2])


def default_platform() -> str:
    return os.environ.get("WHEEL_PLATFORM") or f"manylinux_2_34_{platform.machine()}"


def wheel_filename(pin: Pin, python_tag: str, plat: str) -> str:
    fname = f"{pin.name}-{pin.version}-{python_tag}-{python_tag}-{plat}.whl"
    if fname not in pin.wheels:
        raise ToolError(
            f"no pinned {pin.name} {pin.version} wheel for {python_tag}/{plat}; "
            f"pinned: {', '.join(sorted(pin.wheels))}"
        )
    return fname


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_wheel(pin: Pin, path: Path, source: str | None = None) -> str:
    """Refuse a wheel that is not byte-identical to a pinned one; return its sha256.

    ``source`` names where a user-supplied wheel came from (``--wheel`` or
    ``UPSTREAM_WHEEL``); None means the download cache."""
    if not path.is_file():
        raise ToolError(f"upstream wheel not found: {path}" + _via(source))
    meta = pin.wheels.get(path.name)
    if meta is None:
        raise ToolError(
            f"{path.name} is not a pinned wheel of {pin.name} {pin.version} "
            f"(see {PIN.name})"
        )
    size = path.stat().st_size
    digest = sha256_of(path)
    if size != meta.get("size", size) or digest != meta["sha256"]:
        remedy = (
            "Delete it to download it again."
            if source is None
            else f"Give {source} the pinned wheel itself (or unset it to download it)."
        )
        raise ToolError(
            f"refusing {path}{_via(source)}: sha256 {digest} (size {size}) does not "
            f"match the pinned sha256 {meta['sha256']} (size {meta.get('size')}); "
            f"the file is corrupt, tampered with or another build. {remedy}"
        )
    return digest


def _via(source: str | None) -> str:
    return f" (from {source})" if source else ""


def pip_download(requirement: str, tag: str, plat: str, dest: Path):
    """``pip download`` one binary wheel for interpreter ``tag`` (e.g. cp311)
    and ``plat`` into ``dest``; returns the completed process."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--platform",
        plat,
        "--python-version",
        f"{tag[2]}.{tag[3:]}",
        "--implementation",
        "cp",
        "--abi",
        tag,
        "-d",
        str(dest),
        requirement,
    ]
    return subprocess.run(cmd, capture_output=True, text=True)


def download(pin: Pin, fname: str, cache: Path) -> Path:
    m = re.fullmatch(r".+?-.+?-(cp\d+)-cp\d+-(.+)\.whl", fname)
    assert m, fname
    tag, plat = m.group(1), m.group(2)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        print(f"downloading {fname} ...", file=sys.stderr)
        proc = pip_download(f"{pin.name}=={pin.version}", tag, plat, Path(tmp))
        got = Path(tmp) / fname
        if proc.returncode != 0 or not got.is_file():
            raise ToolError(
                f"could not download {fname} from the package index:\n"
                f"{proc.stderr.strip()[-2000:]}"
            )
        verify_wheel(pin, got)
        dest = cache / fname
        os.replace(got, dest)
    return dest


def locate_wheel(
    pin: Pin, fname: str, wheel: str | None, cache: Path, source: str = "--wheel"
) -> Path:
    if wheel:
        path = Path(wheel)
        if path.name != fname:
            raise ToolError(
                f"{source} {path.name} is not the wheel for this target ({fname})"
            )
        return path
    cached = cache / fname
    if cached.is_file():
        return cached
    return download(pin, fname, cache)


def check_versions(pin: Pin, tree: Path) -> None:
    dist_info = tree / f"{pin.name}-{pin.version}.dist-info"
    metadata = dist_info / "METADATA"
    if not metadata.is_file():
        raise ToolError(f"wheel has no {dist_info.name}/METADATA")
    fields = dict(
        line.split(": ", 1)
        for line in metadata.read_text().split("\n\n", 1)[0].splitlines()
        if ": " in line
    )
    if fields.get("Name") != pin.name or fields.get("Version") != pin.version:
        raise ToolError(
            f"wheel METADATA says {fields.get('Name')} {fields.get('Version')}, "
            f"pin says {pin.name} {pin.version}"
        )
    version_py = (tree / pin.name / "_version.py").read_text()
    if f"__version__ = version = '{pin.version}'" not in version_py:
        raise ToolError(f"{pin.name}/_version.py does not say {pin.version}")


def unpack(pin: Pin, path: Path, dest_root: Path, source: str | None = None) -> Path:
    digest = verify_wheel(pin, path, source)
    dest = dest_root / path.name[: -len(".whl")]
    stamp = dest / STAMP
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return dest
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest_root, prefix=".unpack-"))
    try:
        with zipfile.ZipFile(path) as zf:
            zf.extractall(tmp)
            for info in zf.infolist():  # keep executable bits (Rust extensions)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(tmp / info.filename, mode)
        check_versions(pin, tmp)
        (tmp / STAMP).write_text(digest + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def prepare(
    python_tag: str | None = None,
    plat: str | None = None,
    wheel: str | None = None,
    pin_file: Path = PIN,
) -> tuple[Path, Path]:
    """Return (verified wheel path, unpacked pristine tree)."""
    pin = load_pin(pin_file)
    fname = wheel_filename(
        pin, python_tag or default_python_tag(), plat or default_platform()
    )
    source = None
    if wheel:
        source = "--wheel"
    elif os.environ.get("UPSTREAM_WHEEL"):
        wheel, source = os.environ["UPSTREAM_WHEEL"], "UPSTREAM_WHEEL"
    path = locate_wheel(pin, fname, wheel, CACHE, source or "--wheel")
    return path, unpack(pin, path, UPSTREAM_TREES, source)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["unpack", "wheel-path", "verify"])
    ap.add_argument("--python-tag", help="e.g. cp312 (default: this interpreter)")
    ap.add_argument("--platform", help="e.g. manylinux_2_34_aarch64")
    ap.add_argument("--wheel", help="use this local wheel instead of downloading")
    ap.add_argument("--pin", type=Path, default=PIN)
    args = ap.parse_args()
    if args.command == "verify":
        if not args.wheel:
            raise ToolError("verify needs --wheel PATH")
        print(verify_wheel(load_pin(args.pin), Path(args.wheel), "--wheel"))
        return
    wheel, tree = prepare(args.python_tag, args.platform, args.wheel, args.pin)
    print(wheel if args.command == "wheel-path" else tree)


if __name__ == "__main__":
    run_main(main)
