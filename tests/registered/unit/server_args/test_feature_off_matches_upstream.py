"""Every feature off is upstream 0.5.23, with exactly the exception the README
names.

The README says a PD decode worker with more than one DP rank and the decode
radix cache resolves ``--load-balance-method auto`` to ``cache_aware`` where
0.5.23 resolves ``round_robin`` (the decode radix cache's seed intends it), and
that nothing else of upstream's command lines changes meaning. Both trees (the
pristine unpacked wheel first on ``PYTHONPATH``, then the installed wheel) parse
a grid of upstream command lines (PD mode, DP size, DP attention, the decode
radix cache, the load-balance method) and run the PD and load-balance hooks;
every upstream field of the resolved arguments (or the error) must be equal,
except on exactly the command lines of the README's exception, where
``load_balance_method`` alone differs. The README sentence must name each
condition of that exception.
"""

import itertools
import re
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci

from harness.compare import run_code, upstream_tree

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "series"  # the series group it tests (or "series")
PROJECT_ONLY = "compares with the pristine upstream wheel (harness.compare)"

README = Path(__file__).resolve().parents[4] / "README.md"

# Prints the module it resolved with, then {argv: {field: repr} or error}.
RESOLVE = r"""
import argparse, inspect, json, sys
import sglang.srt.server_args as module
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups.model_override_base import resolved_view
from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
from sglang.srt.arg_groups.serving_hook import handle_load_balance_method

class Refused(Exception):
    pass

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Refused(message)

parser = Parser()
ServerArgs.add_cli_args(parser)
fields = list(inspect.signature(ServerArgs).parameters)
out = {}
for argv in json.load(sys.stdin):
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *argv]))
        handle_pd_disaggregation(args)
        handle_load_balance_method(args)
        view = resolved_view(args)
        out[" ".join(argv)] = {f: repr(getattr(view, f)) for f in fields}
    except Exception as exc:
        out[" ".join(argv)] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"module": module.__file__, "resolved": out}))
"""


# A feature flag (on): the decode HiCache switch implies the decode radix cache.
HICACHE_SWITCH = [
    "--disaggregation-mode",
    "decode",
    "--dp-size",
    "2",
    "--disaggregation-decode-enable-hicache",
]


def command_lines():
    grid = itertools.product(
        ("null", "prefill", "decode"),
        ("1", "2"),
        (False, True),  # --enable-dp-attention
        (False, True),  # --disaggregation-decode-enable-radix-cache
        (None, "auto", "round_robin"),
    )
    for mode, dp, attention, radix, method in grid:
        argv = ["--disaggregation-mode", mode, "--dp-size", dp]
        if attention:
            argv += ["--enable-dp-attention", "--tp-size", dp]
        if radix:
            argv.append("--disaggregation-decode-enable-radix-cache")
        if method:
            argv += ["--load-balance-method", method]
        yield argv


def is_readme_exception(argv) -> bool:
    line = " ".join(argv)
    return (
        "--disaggregation-mode decode" in line
        and "--dp-size 2" in line
        and "--disaggregation-decode-enable-radix-cache" in line
        and "round_robin" not in line  # auto, given or by default
    )


def resolve(argvs, pythonpath=None):
    return run_code(RESOLVE, argvs, pythonpath)


class TestFeatureOffMatchesUpstream(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.argvs = list(command_lines())
        cls.upstream_tree = upstream_tree()
        cls.upstream = resolve(cls.argvs, pythonpath=cls.upstream_tree)
        cls.ours = resolve([*cls.argvs, HICACHE_SWITCH])

    def test_each_tree_is_the_one_named(self):
        # A misconfigured path must not compare our wheel with itself.
        upstream = Path(self.upstream["module"]).resolve()
        ours = Path(self.ours["module"]).resolve()
        self.assertTrue(upstream.is_relative_to(Path(self.upstream_tree).resolve()))
        self.assertFalse(ours.is_relative_to(Path(self.upstream_tree).resolve()))
        self.assertIn("site-packages", ours.parts)

    def test_only_the_readme_exception_differs(self):
        upstream, ours = self.upstream["resolved"], self.ours["resolved"]
        differing, resolved = set(), 0
        for argv in self.argvs:
            key = " ".join(argv)
            up, our = upstream[key], ours[key]
            if isinstance(up, str) or isinstance(our, str):
                self.assertEqual(our, up, key)  # the same refusal
                continue
            resolved += 1
            diff = {f: (v, our[f]) for f, v in up.items() if our[f] != v}
            if diff:
                differing.add(key)
                self.assertEqual(
                    diff, {"load_balance_method": ("'round_robin'", "'cache_aware'")}
                )
        expected = {" ".join(a) for a in self.argvs if is_readme_exception(a)}
        self.assertGreater(resolved, len(self.argvs) // 2)
        self.assertTrue(expected)  # the grid reaches the exception
        self.assertEqual(differing, expected)

    def test_the_readme_names_the_exception(self):
        text = README.read_text()
        match = re.search(r"^Every feature off.*?(?=\n\n)", text, re.M | re.S)
        self.assertIsNotNone(match, "README: the 'Every feature off' paragraph")
        sentence = " ".join(match.group(0).split())
        for condition in (
            "`--disaggregation-mode decode`",
            "`--dp-size` > 1",
            "`--disaggregation-decode-enable-radix-cache`",
            "`--load-balance-method auto`",
            "`cache_aware`",
            "`round_robin`",
        ):
            self.assertIn(condition, sentence)

    def test_decode_hicache_switch_auto_selects_cache_aware(self):
        # Only with both groups installed (a PR test of either cannot see it).
        resolved = self.ours["resolved"][" ".join(HICACHE_SWITCH)]
        self.assertIsInstance(resolved, dict, resolved)
        self.assertEqual(resolved["load_balance_method"], "'cache_aware'")


if __name__ == "__main__":
    unittest.main()
