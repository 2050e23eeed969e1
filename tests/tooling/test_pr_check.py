"""make pr-check: a group's PR tests run as upstream's CPU CI runs them
(``python3 test_x.py`` in its folder) on the pinned release with that PR
alone; the PR's copies import only sglang (the project modules they need
carried under python/sglang/test/); a test that needs an unmapped project
module, or a suite upstream does not run, is refused."""

import ast
import concurrent.futures
import os
import re

import pytest

from .conftest import import_scripts, run_script, sandbox_env

pr_check, pr_tests, warm_python, common, make_pr = import_scripts(
    "pr_check", "pr_tests", "warm_python", "common", "make_pr"
)
ToolError, read_series = common.ToolError, common.read_series
group_needs = common.group_needs

GROUPS = sorted({name.split("/")[0] for name in read_series()})


def _project_imports(path):
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n.split(".")[0] in ("harness", "standins")]


@pytest.fixture(scope="module")
def pr_check_runs(tmp_path_factory, upstream_wheel):
    """``pr_check.py <group>`` of every group in one sandbox (each group
    writes only build/pr/<group> and build/pr-check/<group>[@...]), all at
    once, their jobs sharing one slot per core (``PR_CHECK_SLOTS``, a FIFO
    holding one byte per slot), so the cores stay busy to the end."""
    tmp = tmp_path_factory.mktemp("pr-check")
    env = sandbox_env(tmp, upstream_wheel)
    slots = tmp / "slots"
    os.mkfifo(slots)
    fd = os.open(slots, os.O_RDWR)
    os.write(fd, b"s" * (os.cpu_count() or 1))
    env["PR_CHECK_SLOTS"] = str(slots)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(GROUPS)) as pool:
            futures = {
                g: pool.submit(run_script, "pr_check.py", g, env=env) for g in GROUPS
            }
            return tmp, {g: f.result() for g, f in futures.items()}
    finally:
        os.close(fd)


@pytest.mark.parametrize("group", GROUPS)
def test_pr_tests_pass_upstream_style_on_the_pr_alone(pr_check_runs, group):
    tmp, runs = pr_check_runs
    proc = runs[group]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    entries = [n for n in read_series() if n.startswith(group + "/")]
    tests = pr_tests.feature_tests(group)
    early = [t for t in tests if pr_tests.lands_with(t, entries) != entries[-1]]
    if group == "hicache-rank-shard":  # the config with 0002, DP attention 0011
        assert sorted(t.name for t in early) == [
            "test_hicache_rank_shard_config.py",
            "test_hicache_rank_shard_dp_attention.py",
        ]
    expected = 2 * len(tests) + len(early)  # pristine, early prefixes, whole PR
    assert f"{expected} of {expected} PR test runs pass" in proc.stdout
    # each test ran on pristine 0.5.23 first: failing there, or passing for
    # the reason it declares
    base = "pristine 0.5.23" + "".join(
        f" + {n.split('-')[0]}" for n in group_needs(group)
    )
    pristine = [l for l in proc.stdout.splitlines() if l.endswith(f"({base})")]
    assert len(pristine) == len(tests), pristine
    for test in tests:
        line = next(l for l in pristine if f"/{test.name} (" in l)
        reason = pr_tests.passes_on_pristine(test)
        if reason:
            assert line.startswith(f"passes: {reason}"), line
        else:
            assert line.startswith("fails as required"), line
    # every prefix of the PR imported, in series order; a test that lands
    # early ran after that prefix's import check, on a copy of the layout
    # holding exactly that prefix
    lines = [l for l in proc.stdout.splitlines() if "imports after" in l or "pass" in l]
    prefixes = [re.search(r"imports after (\S+):", l) for l in lines]
    assert [m.group(1) for m in prefixes if m] == entries
    for test in early:
        name = pr_tests.lands_with(test, entries)
        prefix = name.split("/")[1][:4]
        run = f"{test.name} (up to {prefix})"
        at = next(i for i, l in enumerate(lines) if l.endswith(run))
        imported = next(i for i, l in enumerate(lines) if f"imports after {name}:" in l)
        assert imported < at, lines
        snapshot = tmp / "build" / "pr-check" / f"{group}@{prefix}"
        assert _tree_after(tmp, group, entries[: entries.index(name) + 1]) == (
            _tree_after(tmp, group, entries, root=snapshot)
        ), f"{snapshot} does not hold the PR up to {name}"
    layout = tmp / "build" / "pr-check" / group
    sglang = layout / "python" / "sglang"
    assert (sglang / "__init__.py").is_file()
    carried = sorted((layout / "test").rglob("*.py")) + sorted(
        (sglang / "test").glob("*.py")
    )
    for path in carried:
        assert not _project_imports(path), path
        assert "FEATURE_GROUP" not in path.read_text(), path


def _tree_after(tmp, group, entries, root=None):
    """The files the group's patches touch, as they are under ``root``'s
    python/ (default: pristine 0.5.23 with the patches it is stacked on and
    ``entries`` applied, laid out afresh from the sandbox's PR)."""
    out = tmp / "build" / "pr" / group
    if root is None:
        root = tmp / "prefix" / f"{group}-{len(entries)}"
        make_pr.lay_out(out, entries, root, group_needs(group))
    touched = set()
    for patch in out.glob("*.patch"):
        touched |= set(re.findall(r"(?m)^\+\+\+ b/(\S+)$", patch.read_text()))
    assert touched
    return {
        rel: (root / rel).read_bytes() if (root / rel).exists() else None
        for rel in sorted(touched)
    }


def _fake_tests(tmp_path, monkeypatch, test_body):
    tests = tmp_path / "tests"
    (tests / "registered" / "unit").mkdir(parents=True)
    (tests / "harness").mkdir()
    (tests / "standins").mkdir()
    (tests / "harness" / "compare.py").write_text("X = 1\n")
    (tests / "harness" / "fixtures.py").write_text(
        'UPSTREAM_TEST_MODULE = "sglang.test.fake_fixtures"\n\n\n'
        "def build():\n    from standins import ops\n\n    return ops\n"
    )
    (tests / "standins" / "ops.py").write_text(
        'UPSTREAM_TEST_MODULE = "sglang.test.cpu_ops_standin"\n'
    )
    (tests / "registered" / "unit" / "test_fake.py").write_text(
        "from sglang.test.ci.ci_register import register_cpu_ci\n\n"
        + test_body
        + 'FEATURE_GROUP = "fake"\n'
    )
    monkeypatch.setattr(pr_tests, "ROOT", tmp_path)
    monkeypatch.setattr(pr_tests, "TESTS", tests)
    monkeypatch.setattr(pr_tests, "REGISTERED", tests / "registered")


def test_carried_modules_are_renamed_to_their_upstream_names(tmp_path, monkeypatch):
    _fake_tests(
        tmp_path,
        monkeypatch,
        "from harness.fixtures import build\n"
        'register_cpu_ci(est_time=5, suite="base-a-test-cpu")\n',
    )
    out = pr_tests.extract("fake")
    assert out.tests == ["test/registered/unit/test_fake.py"]
    assert set(out.files) == {
        "test/registered/unit/test_fake.py",
        "python/sglang/test/fake_fixtures.py",
        "python/sglang/test/cpu_ops_standin.py",
    }
    test = out.files["test/registered/unit/test_fake.py"]
    assert "from sglang.test.fake_fixtures import build\n" in test
    assert "FEATURE_GROUP" not in test
    fixtures = out.files["python/sglang/test/fake_fixtures.py"]
    assert "    from sglang.test import cpu_ops_standin as ops\n" in fixtures
    assert "UPSTREAM_TEST_MODULE" not in fixtures


def test_an_unmapped_project_module_is_refused(tmp_path, monkeypatch):
    _fake_tests(
        tmp_path,
        monkeypatch,
        "from harness.compare import X\n"
        'register_cpu_ci(est_time=5, suite="base-a-test-cpu")\n',
    )
    with pytest.raises(ToolError, match=r"harness\.compare.*UPSTREAM_TEST_MODULE"):
        pr_tests.extract("fake")


def test_a_suite_upstream_does_not_run_is_refused(tmp_path, monkeypatch):
    _fake_tests(
        tmp_path,
        monkeypatch,
        'register_cpu_ci(est_time=5, suite="stage-a-test-cpu")\n',
    )
    with pytest.raises(ToolError, match="base-a-test-cpu"):
        pr_tests.extract("fake")


def test_a_prefix_that_does_not_import_is_refused_naming_its_patch(
    tmp_path, cold_python
):
    pkg = tmp_path / "python" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "half.py").write_text("from sglang.missing_part import thing\n")
    env = pr_check.layout_env(tmp_path)
    pr_check.import_check(cold_python, tmp_path, env, [], "x/0001-ok.patch")
    with pytest.raises(ToolError, match=r"up to x/0002-half.patch does not import"):
        pr_check.import_check(
            cold_python, tmp_path, env, ["sglang.half"], "x/0002-half.patch"
        )
    patch = tmp_path / "p.patch"
    patch.write_text(
        "+++ b/python/sglang/half.py\n+++ b/python/sglang/pkg/__init__.py\n"
        "+++ b/python/sglang/README.md\n"
    )
    assert pr_check.touched_modules([patch]) == ["sglang.half", "sglang.pkg"]


def test_lands_with_names_a_patch_of_the_group(tmp_path, monkeypatch):
    _fake_tests(
        tmp_path,
        monkeypatch,
        'register_cpu_ci(est_time=5, suite="base-a-test-cpu")\nLANDS_WITH = "0002"\n',
    )
    (path,) = pr_tests.feature_tests("fake")
    entries = ["fake/0001-a.patch", "fake/0002-b.patch", "fake/0003-c.patch"]
    assert pr_tests.lands_with(path, entries) == "fake/0002-b.patch"
    with pytest.raises(ToolError, match=r"LANDS_WITH = '0002' names no patch"):
        pr_tests.lands_with(path, entries[:1])
    assert (
        "LANDS_WITH"
        not in pr_tests.extract("fake").files["test/registered/unit/test_fake.py"]
    )


@pytest.fixture(scope="module")
def cold_python():
    with warm_python.WarmPython(preload=()) as warm:
        yield warm


PRISTINE_BODIES = {
    # every test id fails by its own assertion: required
    "assertion": "def test_a(self):\n        self.assertEqual(1, 2)\n",
    # passes without its patches: proves nothing
    "pass": "def test_a(self):\n        pass\n",
    # fails, but on a missing module: proves nothing about the PR
    "import": "def test_a(self):\n        import sglang_no_such_module\n",
    # one id fails by assertion, another errors
    "mixed": (
        "def test_a(self):\n        self.fail('x')\n"
        "    def test_b(self):\n        raise AttributeError('missing')\n"
    ),
    # one id fails by assertion, another passes
    "one_passes": (
        "def test_a(self):\n        self.fail('x')\n"
        "    def test_b(self):\n        pass\n"
    ),
    # a subtest fails by assertion
    "subtest": (
        "def test_a(self):\n        for i in range(2):\n"
        "            with self.subTest(i=i):\n                self.assertEqual(i, 0)\n"
    ),
    # several failing examples (hypothesis): a group of assertions counts
    "group": (
        "def test_a(self):\n"
        "        raise ExceptionGroup('two', [AssertionError('a'), AssertionError('b')])\n"
    ),
    "group_with_error": (
        "def test_a(self):\n"
        "        raise ExceptionGroup('two', [AssertionError('a'), TypeError('b')])\n"
    ),
    # a module fixture's assertion (a PR's precondition) stops every test
    "module_fixture": (
        "def setUpModule():\n    raise AssertionError('the PR is missing')\n",
        "def test_a(self):\n        pass\n",
    ),
    # ... but its other exceptions do not count
    "module_fixture_error": (
        "def setUpModule():\n    import sglang_no_such_module\n",
        "def test_a(self):\n        pass\n",
    ),
    # a class fixture's assertion stops its tests
    "fixture": (
        "@classmethod\n    def setUpClass(cls):\n        assert False, 'no server'\n"
        "    def test_a(self):\n        pass\n"
    ),
}


def _pristine_row(tmp_path, cold_python, body, reason=None, passing=None):
    module, body = body if isinstance(body, tuple) else ("", body)
    test = tmp_path / "test" / "test_x.py"
    test.parent.mkdir(exist_ok=True)
    test.write_text(
        "import unittest\n\n\ndef register_cpu_ci(**kwargs):\n    pass\n\n\n"
        'register_cpu_ci(est_time=5, suite="base-a-test-cpu")\n\n\n'
        f"{module}\n\n"
        f"class T(unittest.TestCase):\n    {body}\n\n"
        'if __name__ == "__main__":\n    unittest.main()\n'
    )
    env = pr_check.layout_env(tmp_path)
    return pr_check.run_pristine(
        cold_python, tmp_path, test, env, reason, passing_tests=passing
    )


@pytest.mark.parametrize(
    "body, reason, passing, ok",
    [
        ("assertion", None, None, True),
        ("pass", None, None, False),
        ("import", None, None, False),
        ("mixed", None, None, False),
        ("one_passes", None, None, False),
        ("one_passes", None, {"test_b": "a boundary both keep"}, True),
        ("one_passes", None, {"T.test_a": "declared, but it fails"}, False),
        ("subtest", None, None, True),
        ("group", None, None, True),
        ("group_with_error", None, None, False),
        ("fixture", None, None, True),
        ("module_fixture", None, None, True),
        ("module_fixture_error", None, None, False),
        ("pass", "flag-off comparison", None, True),
        ("assertion", "flag-off comparison", None, False),  # declared to pass
    ],
)
def test_pristine_run_requires_each_id_to_fail_by_assertion(
    tmp_path, cold_python, body, reason, passing, ok
):
    row = _pristine_row(tmp_path, cold_python, PRISTINE_BODIES[body], reason, passing)
    assert row[0] == "test/test_x.py (pristine 0.5.23)"
    assert (row[3] == "pass") is ok, row


def test_pristine_run_of_a_file_that_does_not_import(tmp_path, cold_python):
    test = tmp_path / "test" / "test_x.py"
    test.parent.mkdir()
    test.write_text("import sglang_no_such_module\n")
    env = pr_check.layout_env(tmp_path)
    row = pr_check.run_pristine(cold_python, tmp_path, test, env, None)
    assert row[3].startswith("FAIL (not by assertion: <file>: no test ran"), row


def test_slots_shared_through_a_fifo_bound_the_jobs_at_once(tmp_path):
    # Two slots shared by three pr_check processes' views of one FIFO: two
    # holders take both, a job that fails gives its slot back.
    fifo = tmp_path / "slots"
    os.mkfifo(fifo)
    keep = os.open(fifo, os.O_RDWR)
    probe = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.write(keep, b"ab")
    views = [pr_check.Slots(str(fifo)) for _ in range(3)]
    try:
        with views[0].hold():
            with pytest.raises(RuntimeError):
                with views[1].hold():
                    with pytest.raises(BlockingIOError):
                        os.read(probe, 1)  # none left for views[2]
                    raise RuntimeError("the job fails")
            assert len(os.read(probe, 2)) == 1  # the failed job's slot is back
            os.write(keep, b"b")
            with views[2].hold():
                with pytest.raises(BlockingIOError):
                    os.read(probe, 1)
        assert len(os.read(probe, 2)) == 2  # both back once their jobs end
    finally:
        for fd in (keep, probe):
            os.close(fd)
