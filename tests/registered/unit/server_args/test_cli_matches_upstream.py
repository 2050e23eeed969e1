"""Every command line upstream 0.5.23 accepts means the same on our wheel.

argparse resolves an unambiguous prefix of a long option (``--dp 8`` is
``--dp-size 8``: the spelling of SGLang's own DeepSeek commands); a new flag
that shares the prefix makes it ambiguous and the launch is refused. For every
option string of upstream's ``ServerArgs`` parser and every prefix of it that
upstream resolves to one destination, our parser (the installed wheel) must
resolve it to the same destination. Each parser is built in a fresh
interpreter: the pristine unpacked wheel first on ``PYTHONPATH`` for upstream.
"""

import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci

from harness.compare import run_code, upstream_tree

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "series"  # the series group it tests (or "series")
PROJECT_ONLY = "compares with the pristine upstream wheel (harness.compare)"

# Prints {option string or prefix: destination, or null when ambiguous or
# unknown} for the candidates given on stdin, as argparse itself resolves them.
RESOLVE = r"""
import argparse, json, sys
import sglang.srt.server_args as module
from sglang.srt.server_args import ServerArgs

class Ambiguous(Exception):
    pass

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise Ambiguous(message)

parser = Parser()
ServerArgs.add_cli_args(parser)
candidates = json.load(sys.stdin)
if candidates is None:  # first call: the option strings themselves
    candidates = sorted(o for a in parser._actions for o in a.option_strings)
    prefixes = {o[:k] for o in candidates if o.startswith("--") for k in range(3, len(o))}
    candidates = sorted(set(candidates) | prefixes)
out = {}
for arg in candidates:
    try:
        found = parser._parse_optional(arg)
    except Ambiguous:
        found = None
    if isinstance(found, list):  # Python >= 3.12: a list of candidates
        found = found[0] if len(found) == 1 else None
    action = found[0] if found else None
    out[arg] = action.dest if action is not None else None
print(json.dumps({"module": module.__file__, "resolved": out}))
"""


def resolve(candidates, pythonpath=None):
    return run_code(RESOLVE, candidates, pythonpath)


def is_under(module: str, tree) -> bool:
    return Path(module).resolve().is_relative_to(Path(tree).resolve())


class TestCliMatchesUpstream(unittest.TestCase):
    def test_every_upstream_spelling_resolves_the_same(self):
        tree = upstream_tree()
        upstream = resolve(None, pythonpath=tree)
        resolved = {arg: dest for arg, dest in upstream["resolved"].items() if dest}
        answer = resolve(sorted(resolved))
        ours = answer["resolved"]
        # Each parser came from the tree it stands for (a misconfigured path
        # would compare our parser with itself).
        self.assertTrue(is_under(upstream["module"], tree), upstream["module"])
        self.assertFalse(is_under(answer["module"], tree), answer["module"])
        self.assertIn("site-packages", Path(answer["module"]).parts)
        # The check discriminates: exact flags and abbreviations alike.
        self.assertIn("--dp", resolved)
        self.assertEqual(resolved["--dp"], "dp_size")
        self.assertGreater(len(resolved), 1000)
        differ = {
            arg: (dest, ours.get(arg))
            for arg, dest in resolved.items()
            if ours.get(arg) != dest
        }
        self.assertEqual(differ, {})


if __name__ == "__main__":
    unittest.main()
