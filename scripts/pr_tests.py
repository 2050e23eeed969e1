"""Which registered tests a feature's upstream PR carries, and in what form.

A registered test declares, at module level:
  * ``FEATURE_GROUP = "<group>"``: the series group it tests ("series": the
    wheel as a whole); exactly one;
  * ``PROJECT_ONLY = "<why>"`` (optional): it stays in this repository (it
    compares against unpatched upstream, or runs on this project's harness);
  * ``LANDS_WITH = "NNNN"`` (optional): the patch of its group from which on it
    passes (default: the group's last); ``make pr-check`` also runs it on the
    PR's prefix ending there;
  * ``PASSES_ON_PRISTINE = "<why>"`` (optional): it passes on the pristine
    release too (a flag-off comparison); ``make pr-check`` otherwise requires
    every PR test to fail there, without its patches, each test id by its own
    assertion;
  * ``PASSES_ON_PRISTINE_TESTS = {"<test method>": "<why>"}`` (optional): the
    ids that pass on the pristine release on purpose (a boundary both treat
    alike); they must pass there.
Every other test of a group goes into that group's PR and must run upstream:
it imports sglang, the standard library and third-party packages, and of the
project's ``tests/harness`` and ``tests/standins`` only modules that declare
``UPSTREAM_TEST_MODULE = "sglang.test.<name>"``: the PR carries those under
``python/sglang/test/`` and its copies import them by that name.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from common import ROOT, ToolError

TESTS = ROOT / "tests"
REGISTERED = TESTS / "registered"
SERIES_WIDE = "series"
# The CPU suites of upstream's test/run_suite.py (register_cpu_ci(suite=...)).
UPSTREAM_CPU_SUITES = ("base-a-test-cpu", "base-b-test-cpu", "base-c-test-cpu")
_PROJECT_PACKAGES = ("harness", "standins")
_BOOKKEEPING = re.compile(
    r"(?ms)^(?:FEATURE_GROUP|PROJECT_ONLY|LANDS_WITH|PASSES_ON_PRISTINE) = [^\n]*\n"
    r"|^PASSES_ON_PRISTINE_TESTS = \{.*?^\}\n"
)


def module_constants(path: Path, name: str) -> list:
    """The values of the module-level ``<name> = <constant>`` assignments."""
    return [
        node.value.value
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
        and isinstance(node.value, ast.Constant)
    ]


def declared_groups(path: Path) -> list[str]:
    return module_constants(path, "FEATURE_GROUP")


def project_only(path: Path) -> str | None:
    reasons = module_constants(path, "PROJECT_ONLY")
    return reasons[0] if reasons else None


def passes_on_pristine(path: Path) -> str | None:
    """Why the test passes on the pristine release (``PASSES_ON_PRISTINE``), or
    None: it must fail there."""
    reasons = module_constants(path, "PASSES_ON_PRISTINE")
    return reasons[0] if reasons else None


def passing_tests_on_pristine(path: Path) -> dict[str, str]:
    """The test methods of a PR test that pass on the pristine release on
    purpose (a boundary both behave the same on), with why:
    ``PASSES_ON_PRISTINE_TESTS = {"test_name": "<reason>", ...}``, keys a
    method name or ``Class.method``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "PASSES_ON_PRISTINE_TESTS"
            for t in node.targets
        ):
            return dict(ast.literal_eval(node.value))
    return {}


def lands_with(path: Path, entries: list[str]) -> str:
    """The series entry (of ``entries``, its group's patches) from which the
    test passes: its ``LANDS_WITH`` patch number, or the group's last patch."""
    numbers = module_constants(path, "LANDS_WITH")
    if not numbers:
        return entries[-1]
    found = [e for e in entries if Path(e).name.startswith(f"{numbers[0]}-")]
    if len(found) != 1:
        raise ToolError(
            f"{path.relative_to(ROOT)}: LANDS_WITH = {numbers[0]!r} names no patch "
            f"of its group (one of {', '.join(Path(e).name[:4] for e in entries)})"
        )
    return found[0]


def upstream_test_path(path: Path) -> str:
    """Where a registered test goes in upstream's repository."""
    return f"test/registered/{path.relative_to(REGISTERED)}"


def registered_tests() -> list[Path]:
    return sorted(REGISTERED.rglob("test_*.py"))


def feature_tests(feature: str) -> list[Path]:
    """The group's tests that go into its PR."""
    return [
        path
        for path in registered_tests()
        if declared_groups(path) == [feature] and project_only(path) is None
    ]


def cpu_registration(path: Path) -> dict:
    """The keyword/positional arguments of the file's ``register_cpu_ci``."""
    for node in ast.parse(path.read_text()).body:
        call = node.value if isinstance(node, ast.Expr) else None
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "register_cpu_ci"
        ):
            args = dict(zip(("est_time", "suite"), (a.value for a in call.args)))
            args.update({k.arg: k.value.value for k in call.keywords})
            return args
    return {}


@dataclass
class Extraction:
    """What a PR carries for its tests: the test files (upstream path ->
    text) and the project modules they need (python/sglang/test/... -> text)."""

    files: dict[str, str] = field(default_factory=dict)
    tests: list[str] = field(default_factory=list)


def _project_imports(tree: ast.AST) -> list[tuple[ast.stmt, list[tuple[str, str]]]]:
    """Import statements naming harness/standins modules, each with its
    (project module, local name) pairs; ``import harness.x`` is returned with
    an empty list (refused by the caller)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            if top not in _PROJECT_PACKAGES or node.level:
                continue
            if node.module in _PROJECT_PACKAGES:  # from standins import kvcacheio
                pairs = [
                    (f"{node.module}.{a.name}", a.asname or a.name) for a in node.names
                ]
                found.append((node, pairs))
            else:  # from harness.stacks.radix_tree_fixtures import build_tree
                found.append((node, [(node.module, "")]))
        elif isinstance(node, ast.Import):
            if any(a.name.split(".")[0] in _PROJECT_PACKAGES for a in node.names):
                found.append((node, []))
    return found


def _upstream_name(module: str) -> str | None:
    path = TESTS.joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        return None
    names = module_constants(path, "UPSTREAM_TEST_MODULE")
    return names[0] if names else None


def _rewrite(path: Path, text: str, needed: dict[str, str]) -> str:
    """``text`` with its harness/standins imports renamed to their upstream
    modules; adds the modules it uses to ``needed`` (project -> upstream)."""
    lines = text.splitlines(keepends=True)
    imports = _project_imports(ast.parse(text))
    for node, pairs in sorted(imports, key=lambda item: -item[0].lineno):
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        if not pairs:
            raise ToolError(
                f"{where}: use 'from harness.<module> import ...' or 'from "
                "standins import <module>' (the PR renames them)"
            )
        parts = []
        for module, local in pairs:
            target = _upstream_name(module)
            if target is None:
                raise ToolError(
                    f"{where}: imports {module}, which has no UPSTREAM_TEST_MODULE; "
                    "a test that goes upstream uses only sglang (mark the test "
                    "PROJECT_ONLY = '<why>', or declare the module's upstream name)"
                )
            needed[module] = target
            parts.append((target, local))
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        if isinstance(node, ast.ImportFrom) and node.module in _PROJECT_PACKAGES:
            new = [
                f"{indent}from {t.rsplit('.', 1)[0]} import {t.rsplit('.', 1)[1]}"
                + ("" if t.rsplit(".", 1)[1] == local else f" as {local}")
                + "\n"
                for t, local in parts
            ]
        else:
            names = ast.get_source_segment(text, node).split(" import ", 1)[1]
            new = [f"{indent}from {parts[0][0]} import {names}\n"]
        lines[node.lineno - 1 : node.end_lineno] = new
    return "".join(lines)


def _upstream_file(module: str) -> str:
    return "python/" + module.replace(".", "/") + ".py"


def extract(feature: str) -> Extraction:
    """The group's PR tests in upstream's layout, their project modules
    renamed and carried along; refuses a test that needs an unmapped one."""
    out = Extraction()
    needed: dict[str, str] = {}
    for path in feature_tests(feature):
        suite = cpu_registration(path).get("suite")
        if suite not in UPSTREAM_CPU_SUITES:
            raise ToolError(
                f"{path.relative_to(ROOT)}: register_cpu_ci(suite={suite!r}); "
                f"upstream's CPU suites are {', '.join(UPSTREAM_CPU_SUITES)}"
            )
        rel = upstream_test_path(path)
        text = _BOOKKEEPING.sub("", path.read_text())
        out.files[rel] = _rewrite(path, text, needed)
        out.tests.append(rel)
    done: set[str] = set()
    while set(needed) - done:
        module = sorted(set(needed) - done)[0]
        done.add(module)
        path = TESTS.joinpath(*module.split(".")).with_suffix(".py")
        text = re.sub(r"(?m)^UPSTREAM_TEST_MODULE = .*\n", "", path.read_text())
        out.files[_upstream_file(needed[module])] = _rewrite(path, text, needed)
    return out
