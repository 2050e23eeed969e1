"""scripts/negative_controls.py (``make negative-controls``): every cheap
control, run through the real driver on a scratch copy of the installed wheel,
fails on its test's assertion; and the driver's classifier tells an assertion
from a control that breaks nothing, an import error, a collection error, an
assert of sglang's own code and a stale control, and leaves the installed package as it was."""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import import_scripts

(negative_controls,) = import_scripts("negative_controls")

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "scripts" / "negative_controls.py"
DIGEST = "srt/managers/dp_routing/digest.py"

# Loads the module from the sglang package first on the path without running
# sglang/__init__.py (seconds, not the ~20 s of `import sglang`).
SELF_TEST = """
import importlib.util
from pathlib import Path


def load_digest():
    package = importlib.util.find_spec("sglang").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(
        "digest_under_test", Path(package) / "{digest}"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

{at_import}

def test_version():
    assert load_digest().DIGEST_VERSION == 2, "DIGEST_VERSION changed"
"""


def _run(*args, timeout):
    return subprocess.run(
        [sys.executable, str(DRIVER), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _control(name, old, new, test, expected="DIGEST_VERSION changed"):
    return dict(
        name=name,
        level="cheap",
        module=DIGEST,
        old=old,
        new=new,
        tests=[str(test)],
        expected=[expected],
        what="self-test",
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_classifier_and_scratch_copy(tmp_path):
    at_call = tmp_path / "test_at_call.py"
    at_call.write_text(SELF_TEST.format(digest=DIGEST, at_import=""))
    at_import = tmp_path / "test_at_import.py"
    at_import.write_text(SELF_TEST.format(digest=DIGEST, at_import="load_digest()"))
    version = "DIGEST_VERSION = 2\n"
    controls = [
        _control("breaks", version, "DIGEST_VERSION = 3\n", at_call),
        _control("breaks-nothing", version, version + "# no change\n", at_call),
        _control(
            "import-error",
            "from array import array\n",
            "from array import x\n",
            at_call,
        ),
        _control(
            "collection-error",
            "from array import array\n",
            "from array import x\n",
            at_import,
        ),
        _control("wrong-expectation", version, "DIGEST_VERSION = 3\n", at_call, "nope"),
        # the expected text, but from an assert of sglang's own code
        _control(
            "assertion-in-sglang",
            version,
            version + 'assert False, "DIGEST_VERSION changed"\n',
            at_call,
        ),
        _control("stale", "DIGEST_VERSION = 99\n", "", at_call),
        _control("ambiguous", "import ", "", at_call),
    ]
    spec = tmp_path / "controls.json"
    spec.write_text(json.dumps(controls))
    out = tmp_path / "out"
    installed = Path(importlib.util.find_spec("sglang").origin).parent
    before = _sha256(installed / DIGEST)

    try:
        proc = _run("--controls-json", str(spec), "--out", str(out), timeout=900)
        _check_self_test(proc, out, installed, before)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _check_self_test(proc, out: Path, installed: Path, before: str):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _sha256(installed / DIGEST) == before
    summary = json.loads((out / "summary.json").read_text())
    seen = {c["name"]: (c["ok"], c["seen"]) for c in summary["controls"]}
    assert seen["breaks"][0], seen
    assert seen["breaks"][1].startswith("fails on assertion: test_version")
    assert seen["breaks-nothing"] == (False, "PASSED")
    assert not seen["import-error"][0]
    assert seen["import-error"][1].startswith("error: ImportError (not counted)")
    assert not seen["collection-error"][0]
    assert seen["collection-error"][1].startswith("collection error")
    assert not seen["wrong-expectation"][0]
    assert "expected failure not seen: nope" in seen["wrong-expectation"][1]
    assert not seen["assertion-in-sglang"][0]
    assert seen["assertion-in-sglang"][1].startswith(
        "error: AssertionError in sglang ("
    ), seen["assertion-in-sglang"]
    assert f"{DIGEST}:" in seen["assertion-in-sglang"][1]
    assert seen["stale"] == (
        False,
        f"stale control: text not found in {DIGEST}: 'DIGEST_VERSION = 99\\n'",
    )
    assert seen["ambiguous"][1].startswith("stale control: text found ")
    assert summary["not_ok"] == [n for n in seen if n != "breaks"]
    # The table, one row per control.
    for name, (_, text) in seen.items():
        assert f"{name} " in proc.stdout and text[:40] in proc.stdout, name

    # The test ran the mutated copy: a new file in the scratch tree, every
    # other file a hard link of the installed one.
    broke = next(c for c in summary["controls"] if c["name"] == "breaks")
    scratch = out / "breaks" / "sglang"
    assert broke["imported_from"] == str(scratch / DIGEST)
    assert broke["importing_processes"] == 1
    assert (scratch / DIGEST).stat().st_ino != (installed / DIGEST).stat().st_ino
    assert "DIGEST_VERSION = 3\n" in (scratch / DIGEST).read_text()
    other = "srt/managers/dp_routing/index.py"
    if os.stat(out).st_dev == os.stat(installed).st_dev:
        assert (scratch / other).stat().st_ino == (installed / other).stat().st_ino


def test_every_control_names_its_module_text_once():
    installed = Path(importlib.util.find_spec("sglang").origin).parent
    for control in negative_controls.CONTROLS:
        text = (installed / control.module).read_text()
        assert text.count(control.old) == 1, control.name
        for test in control.tests:
            path, *names = test.split("::")
            assert (ROOT / path).is_file(), test
            assert _node_defined(ROOT / path, names), f"{control.name}: no {test}"


def _node_defined(path: Path, names: list) -> bool:
    """Whether ``Class`` / ``Class::test`` of a pytest node id is defined in
    the file (a method may come from a base class of the same file); a node
    id of the whole file names nothing more."""
    import ast

    if not names:
        return True

    classes = {
        n.name: n
        for n in ast.parse(path.read_text()).body
        if isinstance(n, ast.ClassDef)
    }

    def has(cls, method):
        if cls is None:
            return False
        if any(isinstance(f, ast.FunctionDef) and f.name == method for f in cls.body):
            return True
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        return any(has(classes.get(b), method) for b in bases)

    cls = classes.get(names[0]) if names else None
    return cls is not None and (len(names) == 1 or has(cls, names[1]))


def test_cheap_controls_fail_on_their_assertions(tmp_path):
    out = tmp_path / "out"
    try:
        proc = _run("--set", "cheap", "--out", str(out), timeout=3600)
        summary = json.loads((out / "summary.json").read_text())
    finally:  # ~10k hard links per control: not left to pytest's tmp retention
        shutil.rmtree(out, ignore_errors=True)
    print(proc.stdout)
    cheap = [c.name for c in negative_controls.CONTROLS if c.level == "cheap"]
    assert [c["name"] for c in summary["controls"]] == cheap
    for c in summary["controls"]:
        assert c["ok"], (c["name"], c["seen"], c["failures"])
        assert c["seen"].startswith("fails on assertion: "), c["seen"]
        assert c["importing_processes"] >= 1, c["name"]
        if c["sglang"]:
            assert Path(c["sglang"]).is_relative_to(out / c["name"]), c["sglang"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
