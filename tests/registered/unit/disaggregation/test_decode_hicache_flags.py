"""PD decode HiCache flags: --disaggregation-decode-enable-hicache,
--disaggregation-decode-hicache-{ratio,size,write-policy}.

They parse through upstream's argparse path, map onto the generic HiCache
settings of a decode worker in ``handle_pd_disaggregation``, and fail naming the
decode flag where they do not apply, where they contradict a generic flag, or
where 0.5.23 rejects the decode radix cache / HiCache they turn on.
"""

import argparse
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.scenarios.decode_hicache_scenarios import require_decode_hicache

register_cpu_ci(est_time=30, suite="base-a-test-cpu")
FEATURE_GROUP = "decode-hicache"  # the series group it tests (or "series")


def setUpModule():
    require_decode_hicache()


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


if __name__ == "__main__":
    unittest.main()
