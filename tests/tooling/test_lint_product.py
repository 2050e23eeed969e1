"""scripts/lint_product.py: upstream's linters (isort, ruff format, ruff check,
codespell at 0.5.23's versions and settings) and its license header on the
product files a series adds or changes. A clean tree passes; each kind of
defect fails, naming the file and the tool; the release's own copies of the
files the series changes pass, so whole files are checked."""

import re
import subprocess

import pytest

from .conftest import ROOT, import_scripts, run_script

lint_product, common = import_scripts("lint_product", "common")
PATCHES, git_env, read_series = common.PATCHES, common.git_env, common.read_series

HEADER = (
    "# Copyright 2023-2024 SGLang Team\n"
    '# Licensed under the Apache License, Version 2.0 (the "License");\n'
    "# you may not use this file except in compliance with the License.\n"
    "# You may obtain a copy of the License at\n"
    "#\n"
    "#     http://www.apache.org/licenses/LICENSE-2.0\n"
    "#\n"
    "# Unless required by applicable law or agreed to in writing, software\n"
    '# distributed under the License is distributed on an "AS IS" BASIS,\n'
    "# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.\n"
    "# See the License for the specific language governing permissions and\n"
    "# limitations under the License.\n"
    "# " + "=" * 78 + "\n"
)
# Formatted as upstream formats: ruff format's parenthesized assert message
# (black 24 would split the condition instead), sglang first party.
CHANGED = '''"""A module of the release."""

import os

import torch

from sglang.srt.utils import get_device_module


def budget(tokens: int, limit: int) -> int:
    assert tokens >= 0 and limit >= 0 and tokens + limit < 2**40, (
        "token and limit counts must be non-negative"
    )
    return min(tokens, limit) + len(os.sep) + torch.zeros(1).numel()


def device():
    return get_device_module()
'''
NEW = (
    HEADER
    + '''"""A module the series adds."""

from __future__ import annotations


def shard(layers: list[int], ranks: int) -> dict[int, list[int]]:
    """The layers each rank owns."""
    return {r: layers[r::ranks] for r in range(ranks)}
'''
)


def _git(tree, *args):
    subprocess.run(
        ["git", "-C", str(tree), *args], check=True, capture_output=True, env=git_env()
    )


@pytest.fixture
def tree(tmp_path):
    """A git tree like build/src: the release at tag ``upstream``, then the
    series (one changed module, one new module, one new package)."""
    root = tmp_path / "src"
    pkg = root / "sglang" / "srt" / "managers"
    pkg.mkdir(parents=True)
    (pkg / "budget.py").write_text(
        CHANGED.replace("min(tokens, limit)", "max(tokens, limit)")
    )
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "upstream")
    _git(root, "tag", "upstream")
    (pkg / "budget.py").write_text(CHANGED)
    (pkg / "shard.py").write_text(NEW)
    (root / "sglang" / "srt" / "shards").mkdir()
    (root / "sglang" / "srt" / "shards" / "__init__.py").write_text(
        HEADER + "from sglang.srt.managers.shard import shard\n"
    )
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "series")
    return root


TOOL_LINE = re.compile(
    r"^\S+: (isort|ruff format|ruff check|codespell|license header)$"
)


def _named(stderr):
    """The ``<file>: <tool>`` lines of a failing run."""
    return [line for line in stderr.splitlines() if TOOL_LINE.match(line)]


def _lint(tree, *args):
    return run_script("lint_product.py", "--tree", str(tree), *args, env={})


def test_a_clean_series_passes(tree):
    proc = _lint(tree)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the changed module, the new module and the new package's __init__ (which,
    # as upstream has it, ruff check leaves out: its imports are re-exports)
    assert "3 file(s) the series adds or changes" in proc.stdout
    proc = _lint(tree, "--pristine")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 changed file(s) as upstream has them" in proc.stdout


MISSPELT = "reci" + "eved"  # split: this repository's own codespell reads this file
# 100 columns: upstream's line length is 88.
LONG_LINE = (
    "    return "
    + " + ".join(f"budget({i}, {i + 1})" for i in range(5))
    + " + budget(5, 600)\n"
)
assert len(LONG_LINE) == 100 + 1


@pytest.mark.parametrize(
    "defect, edit, tool",
    [
        (
            "a 100-column line",
            lambda s: s + "\n\ndef f():\n" + LONG_LINE,
            "ruff format",
        ),
        (
            "a re-indented body",
            lambda s: s.replace(
                "    return get_device_module()", "  return get_device_module()"
            ),
            "ruff format",
        ),
        (
            "black's assert layout",
            lambda s: s.replace(
                "    assert tokens >= 0 and limit >= 0 and tokens + limit < 2**40, (\n"
                '        "token and limit counts must be non-negative"\n'
                "    )\n",
                "    assert (\n"
                "        tokens >= 0 and limit >= 0 and tokens + limit < 2**40\n"
                '    ), "token and limit counts must be non-negative"\n',
            ),
            "ruff format",
        ),
        (
            "sglang among the third-party imports",
            lambda s: s.replace(
                "import torch\n\nfrom sglang", "import torch\nfrom sglang"
            ),
            "isort",
        ),
        (
            "an unused import",
            lambda s: s.replace("import os\n", "import os\nimport re\n"),
            "ruff check",
        ),
        (
            "a quoted annotation",
            lambda s: s.replace(
                '"""\n\nimport os',
                '"""\n\nfrom __future__ import annotations\n\nimport os',
            ).replace("def device():", 'def device() -> "object":'),
            "ruff check",
        ),
        (
            "a misspelling",
            lambda s: s.replace("non-negative", "non-negative (" + MISSPELT + ")"),
            "codespell",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_each_defect_fails_naming_file_and_tool(tree, defect, edit, tool):
    module = tree / "sglang" / "srt" / "managers" / "budget.py"
    module.write_text(edit(module.read_text()))
    report = tree.parent / "report.txt"
    proc = _lint(tree, "--report", str(report))
    assert proc.returncode == 2, f"{defect} passed:\n{proc.stdout}{proc.stderr}"
    lines = [
        l for l in proc.stderr.splitlines() if ": " in l and not l.startswith("error")
    ]
    assert lines == [f"sglang/srt/managers/budget.py: {tool}"], proc.stderr
    assert f"== sglang/srt/managers/budget.py: {tool}\n" in report.read_text()
    if tool == "ruff format":  # the report holds the change to make
        assert "+++ sglang/srt/managers/budget.py" in report.read_text()


def test_a_new_module_without_the_license_header_fails(tree):
    new = tree / "sglang" / "srt" / "managers" / "shard.py"
    new.write_text(NEW.removeprefix(HEADER))  # uncommitted edits count too
    empty = tree / "sglang" / "srt" / "empty" / "__init__.py"
    empty.parent.mkdir()
    empty.write_text("")  # an empty package marker needs none (untracked: new)
    proc = _lint(tree)
    assert proc.returncode == 2
    assert "sglang/srt/managers/shard.py: license header" in proc.stderr
    assert "empty" not in proc.stderr
    # a changed module of the release keeps the header it has (none here)
    assert "budget.py" not in proc.stderr


def test_patch_files_name_added_and_changed_python_files(tmp_path):
    patch = tmp_path / "0001.patch"
    patch.write_text(
        "Subject: x\n---\n"
        "diff --git a/python/sglang/a.py b/python/sglang/a.py\n"
        "--- a/python/sglang/a.py\n+++ b/python/sglang/a.py\n@@ -1 +1 @@\n-x\n+y\n"
        "diff --git a/python/sglang/b.py b/python/sglang/b.py\nnew file mode 100644\n"
        "--- /dev/null\n+++ b/python/sglang/b.py\n@@ -0,0 +1 @@\n+z\n"
        "diff --git a/python/sglang/c.py b/python/sglang/c.py\ndeleted file mode 100644\n"
        "--- a/python/sglang/c.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-z\n"
        "diff --git a/docs/d.md b/docs/d.md\n--- a/docs/d.md\n+++ b/docs/d.md\n"
    )
    files, new = lint_product.patch_files([patch])
    assert files == ["python/sglang/a.py", "python/sglang/b.py"]
    assert new == ["python/sglang/b.py"]


def test_the_release_passes_on_every_file_the_series_changes():
    """Pristine 0.5.23's copies of the files the series changes pass each of
    upstream's linters: a finding on a changed file is the series' own."""
    pristine = run_script("upstream.py", "unpack", env={}, check=True).stdout
    pristine = ROOT / pristine.strip().splitlines()[-1]
    files, new = lint_product.patch_files([PATCHES / name for name in read_series()])
    changed = [f for f in files if f not in new]
    assert len(changed) > 10
    assert lint_product.lint(pristine, changed) == []


def test_fix_rewrites_what_the_tools_can_and_leaves_the_rest(tree):
    module = tree / "sglang" / "srt" / "managers" / "budget.py"
    text = module.read_text().replace("import os\n", "import os\nimport re\n")
    module.write_text(text.replace("import torch\n\nfrom", "import torch\nfrom") + "\n")
    new = tree / "sglang" / "srt" / "managers" / "shard.py"
    new.write_text(NEW.removeprefix(HEADER))
    proc = _lint(tree, "--fix")
    assert module.read_text() == CHANGED
    assert _named(proc.stderr) == ["sglang/srt/managers/shard.py: license header"]
