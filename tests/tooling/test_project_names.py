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


# Helpers that return project modules: ``a, b = import_scripts("a", "b")``
# (tests/tooling/conftest.py) and ``m = load_module(name, path)``.
MODULE_LOADERS = {"import_scripts", "load_module"}


def _root_name(node: ast.AST) -> str | None:
    """``a`` of ``a.b.c``."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _loaded_modules(node: ast.Assign) -> list[str]:
    call = node.value
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id in MODULE_LOADERS
    ):
        return []
    names = []
    for target in node.targets:
        elts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        names += [e.id for e in elts if isinstance(e, ast.Name)]
    return names


def private_reaches(path: Path) -> list[str]:
    """``from <project module> import _x`` (absolute or relative),
    ``<project module>[.<sub>]._x`` and ``getattr(<project module>, "_x")``
    in ``path``, as ``"<line>: <what>"``; a project module is one imported
    from a project package or folder, or returned by ``import_scripts`` /
    ``load_module``."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()  # local names bound to project modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT_TOPS:
                    modules.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            source = "." * node.level + (node.module or "")
            if not node.level and source.split(".")[0] not in PROJECT_TOPS:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {source} import {alias.name}")
                else:  # maybe a module: from harness import load_record
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Assign):
            modules.update(_loaded_modules(node))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and _root_name(node.value) in modules
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and _root_name(node.args[0]) in modules
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
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
        "from .conftest import _helper\n"
        "import harness.gloo_ranks\n"
        "harness.gloo_ranks._runner\n"
        "lint_product, common = import_scripts('lint_product', 'common')\n"
        "common._root\n"
        "getattr(lint_product, '_tools')\n"
        "getattr(lint_product, 'tools')\n"
        "local = object()\n"
        "local._private\n"
    )
    assert private_reaches(probe) == [
        "2: from pr_check import _env",
        "4: upstream._check_versions",
        "5: g._runner",
        "7: from .conftest import _helper",
        "9: harness.gloo_ranks._runner",
        "11: common._root",
        "12: getattr(lint_product, '_tools')",
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
