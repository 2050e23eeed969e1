"""Names in scripts/, tests/ and benchmark/: a harness or stand-in module that
goes upstream has the name it has there, no two modules share a file name, and
no module reaches into another project module's private (``_name``) names."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from .conftest import ROOT, import_scripts

(pr_tests,) = import_scripts("pr_tests")

FOLDERS = ("scripts", "tests", "benchmark")
# Top-level names under which project modules are imported: the scripts (run
# as files, so imported by their stem), the test packages and the benchmarks;
# sgl_kernel is the GPU stand-in package of tests/standins/gpu.
PROJECT_TOPS = {p.stem for p in (ROOT / "scripts").glob("*.py")} | {
    "benchmark",
    "harness",
    "sgl_kernel",
    "standins",
    "tooling",
}


def _files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(path: Path) -> list[str]:
    """``from <project module> import _x`` and ``<project module>._x`` in
    ``path``, as ``"<line>: <what>"``."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()  # local names bound to project modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT_TOPS:
                    modules.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] not in PROJECT_TOPS:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(
                        f"{node.lineno}: from {node.module} import {alias.name}"
                    )
                else:  # maybe a module: from harness import load_record
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _private(node.attr)
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_no_private_names_across_modules():
    reaches = {
        str(path.relative_to(ROOT)): found
        for path in _files()
        if (found := private_reaches(path))
    }
    assert reaches == {}


def test_the_check_sees_a_private_reach(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import upstream\n"
        "from pr_check import _env\n"
        "from harness import gloo_ranks as g\n"
        "upstream._check_versions(None, None)\n"
        "g._runner\n"
        "upstream.__name__\n"
    )
    assert private_reaches(probe) == [
        "2: from pr_check import _env",
        "4: upstream._check_versions",
        "5: g._runner",
    ]


def test_upstream_bound_modules_keep_their_upstream_name():
    wrong = {}
    for path in _files():
        for name in pr_tests.module_constants(path, "UPSTREAM_TEST_MODULE"):
            if name.rsplit(".", 1)[1] != path.stem:
                wrong[str(path.relative_to(ROOT))] = name
    assert wrong == {}


def test_no_two_modules_share_a_file_name():
    by_name = defaultdict(list)
    for path in _files():
        if path.name not in ("__init__.py", "conftest.py"):
            by_name[path.name].append(str(path.relative_to(ROOT)))
    assert {n: p for n, p in by_name.items() if len(p) > 1} == {}
