"""PD decode HiCache flags: --disaggregation-decode-enable-hicache,
--disaggregation-decode-hicache-{ratio,size,write-policy}.

They parse through upstream's argparse path, map onto the generic HiCache
settings of a decode worker in ``handle_pd_disaggregation``, and fail naming the
decode flag where they do not apply, where they contradict a generic flag, or
where 0.5.23 rejects the decode radix cache / HiCache they turn on. Against
pristine upstream (``harness.compare``, full resolution pipeline on CPU):
command lines without them resolve identically, and the decode flags resolve
exactly as upstream resolves the generic flags they stand for.
"""

import argparse
import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.compare import diff_results, run_scenario
from harness.decode_hicache_scenarios import write_model_config

register_cpu_ci(est_time=90, suite="stage-a-test-cpu")
FEATURE_GROUP = "decode-hicache"  # the series group it tests (or "series")

HICACHE = "--disaggregation-decode-enable-hicache"
RADIX = "--disaggregation-decode-enable-radix-cache"
DECODE = ["--disaggregation-mode", "decode"]
SEED_INTERFACE = [
    *DECODE,
    "--disaggregation-transfer-backend",
    "mooncake",
    RADIX,
    HICACHE,
    "--disaggregation-decode-hicache-ratio",
    "2.0",
]
NEW_FIELDS = {
    "disaggregation_decode_enable_hicache": False,
    "disaggregation_decode_hicache_ratio": None,
    "disaggregation_decode_hicache_size": None,
    "disaggregation_decode_hicache_write_policy": None,
}
SCENARIO = "harness.decode_hicache_scenarios:resolve_command_lines"


def _parse(*argv):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *argv]))


def _resolve(*argv):
    """Run the HiCache/PD hooks in pipeline order (a dummy model path returns
    before handle_pd_disaggregation, so call them directly); return the view."""
    from sglang.srt.arg_groups.hicache_hook import (
        handle_hicache,
        handle_hicache_ratio_default,
    )
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation

    server_args = _parse(*argv)
    handle_hicache_ratio_default(server_args)
    handle_pd_disaggregation(server_args)
    handle_hicache(server_args)
    return resolved_view(server_args)


class TestDecodeHiCacheFlagParsing(unittest.TestCase):
    def test_seed_interface_parses(self):
        args = _parse(*SEED_INTERFACE)
        self.assertTrue(args.disaggregation_decode_enable_hicache)
        self.assertEqual(args.disaggregation_decode_hicache_ratio, 2.0)
        # Raw inputs stay raw; the mapping is a resolution declaration.
        self.assertFalse(args.enable_hierarchical_cache)
        self.assertIsNone(args.hicache_ratio)

    def test_defaults_and_choices(self):
        args = _parse()
        for name, default in NEW_FIELDS.items():
            self.assertEqual(getattr(args, name), default, name)
        args = _parse(
            "--disaggregation-decode-hicache-size",
            "16",
            "--disaggregation-decode-hicache-write-policy",
            "write_through_selective",
        )
        self.assertEqual(args.disaggregation_decode_hicache_size, 16)
        self.assertEqual(
            args.disaggregation_decode_hicache_write_policy, "write_through_selective"
        )
        with self.assertRaises(SystemExit):
            _parse("--disaggregation-decode-hicache-write-policy", "write_never")
        with self.assertRaises(SystemExit):
            _parse("--disaggregation-decode-hicache-size", "1.5")

    def test_fields_are_in_the_disagg_namespace(self):
        import inspect

        from sglang.srt.arg_groups.field_order import POSITIONAL_FIELD_ORDER
        from sglang.srt.arg_groups.fields.disagg import Disagg
        from sglang.srt.server_args import ServerArgs

        for name in NEW_FIELDS:
            self.assertIn(name, Disagg.__struct_fields__)
            self.assertNotIn(name, POSITIONAL_FIELD_ORDER)
        # After every listed field in the constructor's signature, so
        # positional construction of the older fields is unchanged.
        order = list(inspect.signature(ServerArgs).parameters)
        listed = [n for n in order if n in POSITIONAL_FIELD_ORDER]
        self.assertEqual(order[: len(listed)], listed)
        for name in NEW_FIELDS:
            self.assertGreaterEqual(order.index(name), len(listed))


class TestDecodeHiCacheFlagResolution(unittest.TestCase):
    def test_seed_interface_resolves(self):
        view = _resolve(*SEED_INTERFACE)
        self.assertTrue(view.enable_hierarchical_cache)
        self.assertEqual(view.hicache_ratio, 2.0)
        self.assertTrue(view.disaggregation_decode_enable_radix_cache)
        self.assertFalse(view.disable_radix_cache)
        self.assertIsNone(view.hicache_host_memory_fraction)

    def test_enable_alone_implies_decode_radix_cache(self):
        view = _resolve(*DECODE, HICACHE)
        self.assertTrue(view.enable_hierarchical_cache)
        self.assertTrue(view.disaggregation_decode_enable_radix_cache)
        self.assertFalse(view.disable_radix_cache)
        # Ratio left to the decode default (kv_cache_builder), as upstream.
        self.assertIsNone(view.hicache_ratio)
        self.assertEqual(view.hicache_size, 0)
        self.assertEqual(view.hicache_write_policy, "write_through")
        self.assertEqual(view.hicache_host_memory_fraction, 0.8)

    def test_size_and_write_policy(self):
        view = _resolve(
            *DECODE,
            HICACHE,
            "--disaggregation-decode-hicache-size",
            "24",
            "--disaggregation-decode-hicache-write-policy",
            "write_back",
        )
        self.assertEqual(view.hicache_size, 24)
        self.assertEqual(view.hicache_write_policy, "write_back")
        self.assertIsNone(view.hicache_host_memory_fraction)

    def test_equal_generic_value_is_accepted(self):
        view = _resolve(
            *DECODE,
            HICACHE,
            "--disaggregation-decode-hicache-ratio",
            "3",
            "--hicache-ratio",
            "3.0",
            "--disaggregation-decode-hicache-write-policy",
            "write_back",
            "--hicache-write-policy",
            "write_back",
            "--enable-hierarchical-cache",
        )
        self.assertEqual(view.hicache_ratio, 3.0)
        self.assertEqual(view.hicache_write_policy, "write_back")

    def test_generic_flags_apply_when_the_decode_one_is_unset(self):
        view = _resolve(*DECODE, HICACHE, "--hicache-size", "8")
        self.assertEqual(view.hicache_size, 8)

    def test_auto_selects_cache_aware_routing(self):
        # With the cache-aware-routing group also applied: the decode HiCache
        # switch implies the decode radix cache, which auto-selects it.
        import inspect

        from sglang.srt.server_args import ServerArgs

        if "dp_routing_pending_ttl" not in inspect.signature(ServerArgs).parameters:
            self.skipTest("needs the cache-aware-routing group")
        from sglang.srt.arg_groups.model_override_base import resolved_view
        from sglang.srt.arg_groups.pd_disaggregation_hook import (
            handle_pd_disaggregation,
        )
        from sglang.srt.arg_groups.serving_hook import handle_load_balance_method

        server_args = _parse(*DECODE, HICACHE, "--dp-size", "2", "--page-size", "1")
        handle_pd_disaggregation(server_args)
        handle_load_balance_method(server_args)
        self.assertEqual(resolved_view(server_args).load_balance_method, "cache_aware")

    def test_flags_off_leave_no_declaration(self):
        from sglang.srt.arg_groups.pd_disaggregation_hook import (
            handle_pd_disaggregation,
        )

        for argv in ([], DECODE, [*DECODE, RADIX, "--enable-hierarchical-cache"]):
            server_args = _parse(*argv)
            handle_pd_disaggregation(server_args)
            sources = {s for s, _ in getattr(server_args, "_resolved_overrides", ())}
            self.assertNotIn("resolve_decode_hicache_flags", sources, argv)
        server_args = _parse(*DECODE, HICACHE)
        handle_pd_disaggregation(server_args)
        sources = {s for s, _ in getattr(server_args, "_resolved_overrides", ())}
        self.assertIn("resolve_decode_hicache_flags", sources)


class TestDecodeHiCacheFlagErrors(unittest.TestCase):
    def assertRejected(self, argv, *fragments):
        with self.assertRaises(ValueError) as ctx:
            _resolve(*argv)
        for fragment in fragments:
            self.assertIn(fragment, str(ctx.exception))

    def test_not_a_decode_worker(self):
        for mode in ("null", "prefill"):
            with self.subTest(mode=mode):
                self.assertRejected(
                    ["--disaggregation-mode", mode, HICACHE],
                    HICACHE,
                    f"got --disaggregation-mode {mode}",
                )
                self.assertRejected(
                    [
                        "--disaggregation-mode",
                        mode,
                        "--disaggregation-decode-hicache-ratio",
                        "2",
                    ],
                    "--disaggregation-decode-hicache-ratio only applies to a "
                    "decode worker",
                )

    def test_settings_without_enable(self):
        for flag, value in (
            ("--disaggregation-decode-hicache-ratio", "2"),
            ("--disaggregation-decode-hicache-size", "4"),
            ("--disaggregation-decode-hicache-write-policy", "write_back"),
        ):
            with self.subTest(flag=flag):
                # Also with the generic decode HiCache spelled out.
                for extra in ([], [RADIX, "--enable-hierarchical-cache"]):
                    self.assertRejected(
                        [*DECODE, *extra, flag, value], f"{flag} requires {HICACHE}"
                    )

    def test_non_positive_sizes(self):
        for flag, value in (
            ("--disaggregation-decode-hicache-ratio", "0"),
            ("--disaggregation-decode-hicache-ratio", "-1.5"),
            ("--disaggregation-decode-hicache-size", "0"),
        ):
            with self.subTest(flag=flag, value=value):
                self.assertRejected(
                    [*DECODE, HICACHE, flag, value], f"{flag} must be > 0"
                )

    def test_differing_generic_value(self):
        for flag, value, generic, other in (
            ("--disaggregation-decode-hicache-ratio", "2", "--hicache-ratio", "3"),
            ("--disaggregation-decode-hicache-size", "4", "--hicache-size", "8"),
            (
                "--disaggregation-decode-hicache-write-policy",
                "write_back",
                "--hicache-write-policy",
                "write_through_selective",
            ),
        ):
            with self.subTest(flag=flag):
                self.assertRejected(
                    [*DECODE, HICACHE, flag, value, generic, other],
                    f"{flag} {float(value) if 'ratio' in flag else value} "
                    f"conflicts with {generic} "
                    f"{float(other) if 'ratio' in flag else other}",
                )

    def test_reused_decode_radix_cache_checks_name_the_flag(self):
        for extra, message in (
            (
                ["--enable-hisparse"],
                f"{HICACHE} is incompatible with --enable-hisparse",
            ),
            (
                ["--disaggregation-transfer-backend", "fake"],
                f"{HICACHE} is incompatible with --disaggregation-transfer-backend fake",
            ),
            (
                ["--disaggregation-decode-allocation-policy", "prefill_complete"],
                f"decode radix cache or decode HiCache ({HICACHE})",
            ),
        ):
            with self.subTest(extra=extra):
                self.assertRejected([*DECODE, HICACHE, *extra], message)
        # Without the decode flag the messages stay upstream's.
        self.assertRejected(
            [*DECODE, RADIX, "--enable-hisparse"],
            f"{RADIX} is incompatible with --enable-hisparse",
        )

    def test_swa_with_hicache_names_the_flag(self):
        from sglang.srt.mem_cache.kv_cache_builder import validate_decode_radix_cache

        kwargs = dict(
            model_config=object(),
            token_to_kv_pool=object(),
            is_hybrid_swa=True,
            enable_hierarchical_cache=True,
        )
        with self.assertRaisesRegex(
            ValueError, "incompatible with --enable-hierarchical-cache\\.$"
        ):
            validate_decode_radix_cache(**kwargs)
        with self.assertRaisesRegex(ValueError, f"incompatible with {HICACHE}\\.$"):
            validate_decode_radix_cache(**kwargs, hicache_flag=HICACHE)


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
