"""PD decode HiCache flags against pristine upstream (``harness.compare``, the
full resolution pipeline on CPU with a tiny local model config): command lines
without them resolve identically, the decode flags resolve exactly as upstream
resolves the generic flags they stand for, and 0.5.23's rejections name the
decode flag.
"""

import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.compare import run_scenario
from harness.result_diff import diff_results
from harness.scenarios.decode_hicache_flag_scenarios import write_model_config

# The command lines of the PR test this comparison complements (same folder).
from test_decode_hicache_flags import (  # isort: skip
    DECODE,
    HICACHE,
    NEW_FIELDS,
    RADIX,
    SEED_INTERFACE,
)

register_cpu_ci(est_time=90, suite="base-a-test-cpu")
FEATURE_GROUP = "decode-hicache"  # the series group it tests (or "series")
PROJECT_ONLY = "compares with unpatched upstream (this project's harness.compare)"

SCENARIO = "harness.scenarios.decode_hicache_flag_scenarios:resolve_command_lines"


# Full resolution pipeline (CPU, tiny local model config), upstream vs patched.
COMMON = ["--random-seed", "0"]
FLAG_OFF_CASES = {
    "plain": [],
    "plain_hicache": [
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "3",
        "--hicache-write-policy",
        "write_back",
    ],
    "prefill": ["--disaggregation-mode", "prefill"],
    "prefill_hicache": [
        "--disaggregation-mode",
        "prefill",
        "--enable-hierarchical-cache",
        "--hicache-size",
        "4",
    ],
    "decode": DECODE,
    "decode_radix": [*DECODE, RADIX],
    "decode_radix_hicache": [
        *DECODE,
        RADIX,
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "1.5",
        "--hicache-write-policy",
        "write_through_selective",
    ],
    "decode_radix_hicache_size": [
        *DECODE,
        RADIX,
        "--enable-hierarchical-cache",
        "--hicache-size",
        "6",
    ],
    "decode_radix_fake": [*DECODE, RADIX, "--disaggregation-transfer-backend", "fake"],
    "decode_radix_ngram": [*DECODE, RADIX, "--speculative-algorithm", "NGRAM"],
}
# Patched command line with the decode flags -> the generic command line upstream
# resolves it like.
EQUIVALENT = {
    "seed_interface": (
        SEED_INTERFACE,
        [
            *DECODE,
            "--disaggregation-transfer-backend",
            "mooncake",
            RADIX,
            "--enable-hierarchical-cache",
            "--hicache-ratio",
            "2.0",
        ],
    ),
    "enable_only": (
        [*DECODE, HICACHE],
        [*DECODE, RADIX, "--enable-hierarchical-cache"],
    ),
    "size_policy": (
        [
            *DECODE,
            HICACHE,
            "--disaggregation-decode-hicache-size",
            "6",
            "--disaggregation-decode-hicache-write-policy",
            "write_back",
        ],
        [
            *DECODE,
            RADIX,
            "--enable-hierarchical-cache",
            "--hicache-size",
            "6",
            "--hicache-write-policy",
            "write_back",
        ],
    ),
}
# Rejections 0.5.23 makes for the decode radix cache / HiCache, reached through
# the decode flag in the real hook order: (patched argv, upstream argv).
REJECTED = {
    "fake": (
        [*DECODE, HICACHE, "--disaggregation-transfer-backend", "fake"],
        [*DECODE, RADIX, "--disaggregation-transfer-backend", "fake"],
    ),
    "hisparse": (
        [*DECODE, HICACHE, "--enable-hisparse"],
        [*DECODE, RADIX, "--enable-hisparse"],
    ),
    "ngram": (
        [*DECODE, HICACHE, "--speculative-algorithm", "NGRAM"],
        [*DECODE, RADIX, "--speculative-algorithm", "NGRAM"],
    ),
    "prefill_complete": (
        [
            *DECODE,
            HICACHE,
            "--disaggregation-decode-allocation-policy",
            "prefill_complete",
        ],
        [
            *DECODE,
            RADIX,
            "--disaggregation-decode-allocation-policy",
            "prefill_complete",
        ],
    ),
}


class TestDecodeHiCacheFlagsVsUpstream(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(tmp.cleanup)
        model_dir = write_model_config(tmp.name)
        upstream_cases = {f"off.{k}": v for k, v in FLAG_OFF_CASES.items()}
        patched_cases = dict(upstream_cases)
        for name, (patched, generic) in EQUIVALENT.items():
            upstream_cases[f"eq.{name}"] = generic
            patched_cases[f"eq.{name}"] = patched
        for name, (patched, generic) in REJECTED.items():
            upstream_cases[f"rej.{name}"] = generic
            patched_cases[f"rej.{name}"] = patched

        def run(which, cases):
            cases = {k: [*COMMON, *v] for k, v in cases.items()}
            return run_scenario(
                which, SCENARIO, 1, model_dir=model_dir, cases=cases, timeout=300
            )[0]

        cls.upstream = run("upstream", upstream_cases)
        cls.patched = run("patched", patched_cases)

    def _case(self, which, name):
        return getattr(self, which)["cases"][name]

    def _upstream_fields(self, result, upstream):
        return {k: v for k, v in result["fields"].items() if k in upstream["fields"]}

    def test_trees(self):
        self.assertEqual(self.upstream["sglang"]["version"], "0.5.23")
        self.assertNotEqual(
            self.upstream["sglang"]["file"], self.patched["sglang"]["file"]
        )

    def test_flags_off_resolve_like_upstream(self):
        for name in FLAG_OFF_CASES:
            with self.subTest(case=name):
                up = self._case("upstream", f"off.{name}")
                pa = self._case("patched", f"off.{name}")
                if "error" in up:
                    self.assertEqual(pa, up)
                    continue
                self.assertNotIn("error", pa)
                self.assertEqual(
                    diff_results(up["fields"], self._upstream_fields(pa, up)), []
                )
                self.assertEqual(
                    diff_results(up["declarations"], pa["declarations"]), []
                )
                for field, default in NEW_FIELDS.items():
                    self.assertEqual(pa["fields"][field], default, field)
        # The cases discriminate: hicache and radix settings differ between them.
        resolved = {
            (
                f["enable_hierarchical_cache"],
                f["disable_radix_cache"],
                f["hicache_ratio"],
                f["hicache_size"],
                f["hicache_write_policy"],
            )
            for r in self.upstream["cases"].values()
            if "fields" in r
            for f in [r["fields"]]
        }
        self.assertGreaterEqual(len(resolved), 6)
        self.assertIn(
            "incompatible",
            self._case("upstream", "off.decode_radix_ngram")["error"],
        )

    def test_decode_flags_resolve_like_the_generic_flags_upstream(self):
        for name in EQUIVALENT:
            with self.subTest(case=name):
                up = self._case("upstream", f"eq.{name}")
                pa = self._case("patched", f"eq.{name}")
                self.assertNotIn("error", up)
                self.assertNotIn("error", pa)
                self.assertTrue(up["fields"]["enable_hierarchical_cache"])
                self.assertEqual(
                    diff_results(up["fields"], self._upstream_fields(pa, up)), []
                )
        seed = self._case("patched", "eq.seed_interface")["fields"]
        self.assertTrue(seed["enable_hierarchical_cache"])
        self.assertEqual(seed["hicache_ratio"], 2.0)
        self.assertFalse(seed["disable_radix_cache"])

    def test_upstream_rejections_name_the_decode_flag(self):
        for name in REJECTED:
            with self.subTest(case=name):
                up = self._case("upstream", f"rej.{name}")["error"]
                pa = self._case("patched", f"rej.{name}")["error"]
                if name == "prefill_complete":
                    expected = up.replace(
                        "decode radix cache or decode HiCache",
                        f"decode radix cache or decode HiCache ({HICACHE})",
                    )
                else:
                    self.assertIn(RADIX, up)
                    expected = up.replace(RADIX, HICACHE)
                self.assertNotEqual(expected, up)
                self.assertEqual(pa, expected)


if __name__ == "__main__":
    unittest.main()
