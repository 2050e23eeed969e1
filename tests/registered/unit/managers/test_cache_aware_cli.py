"""CLI of cache-aware DP routing: flags parse and validate, ``auto`` selects
``cache_aware`` for multi-DP PD decode with the decode radix cache, and it is
refused where it cannot work."""

import argparse
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.dp_routing_fixtures import require_cache_aware_routing

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "cache-aware-routing"  # the series group it tests (or "series")


def setUpModule():
    require_cache_aware_routing()


def _parse(*argv):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *argv]))


def _resolve(**kwargs):
    """Run the load-balance hook as the resolution pipeline does (a dummy model
    path returns before it, so call it directly); return the resolved method
    and chunk size."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.arg_groups.serving_hook import handle_load_balance_method
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", **kwargs)
    handle_load_balance_method(server_args)
    view = resolved_view(server_args)
    return view.load_balance_method, view.dp_routing_digest_chunk_size


DECODE = dict(
    disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True
)


class TestCacheAwareCli(unittest.TestCase):
    def test_flags_parse(self):
        args = _parse(
            "--load-balance-method",
            "cache_aware",
            "--dp-size",
            "4",
            "--dp-routing-digest-chunk-size",
            "128",
            "--dp-routing-max-extra-reqs",
            "3",
            "--dp-routing-digest-max-age",
            "2.5",
            "--dp-routing-digest-publish-interval",
            "0.2",
            "--dp-routing-pending-ttl",
            "0",
        )
        self.assertEqual(args.load_balance_method, "cache_aware")
        self.assertEqual(args.dp_routing_digest_chunk_size, 128)
        self.assertEqual(args.dp_routing_max_extra_reqs, 3)
        self.assertEqual(args.dp_routing_digest_max_age, 2.5)
        self.assertEqual(args.dp_routing_digest_publish_interval, 0.2)
        self.assertEqual(args.dp_routing_pending_ttl, 0.0)
        defaults = _parse()
        self.assertEqual(defaults.dp_routing_pending_ttl, 2.0)
        self.assertEqual(defaults.load_balance_method, "auto")
        self.assertIsNone(defaults.dp_routing_digest_chunk_size)
        with self.assertRaises(SystemExit):
            _parse("--load-balance-method", "cache_awareness")

    def test_method_is_known_to_controller_and_load_channel(self):
        from sglang.srt.managers.data_parallel_controller import LoadBalanceMethod
        from sglang.srt.managers.load_snapshot import _LOAD_AWARE_METHODS

        self.assertIs(
            LoadBalanceMethod.from_str("cache_aware"), LoadBalanceMethod.CACHE_AWARE
        )
        self.assertIn("cache_aware", _LOAD_AWARE_METHODS)

    def test_chunk_size_resolution_and_validation(self):
        self.assertEqual(
            _resolve(dp_size=2, load_balance_method="cache_aware", page_size=16),
            ("cache_aware", 64),
        )
        self.assertEqual(
            _resolve(dp_size=2, load_balance_method="cache_aware", page_size=96),
            ("cache_aware", 96),
        )
        self.assertEqual(
            _resolve(
                dp_size=2,
                load_balance_method="cache_aware",
                page_size=16,
                dp_routing_digest_chunk_size=48,
            ),
            ("cache_aware", 48),
        )
        for bad in (40, 0, -16):
            with self.subTest(chunk=bad), self.assertRaisesRegex(
                ValueError, "positive multiple of the radix tree page size 16"
            ):
                _resolve(
                    dp_size=2,
                    load_balance_method="cache_aware",
                    page_size=16,
                    dp_routing_digest_chunk_size=bad,
                )

    def test_other_flag_validation(self):
        for kwargs, msg in (
            (dict(dp_routing_max_extra_reqs=-1), "max-extra-reqs must be >= 0"),
            (dict(dp_routing_digest_max_age=0.0), "digest-max-age must be a finite"),
            (dict(dp_routing_digest_max_age=float("inf")), "digest-max-age must be"),
            (dict(dp_routing_digest_max_age=float("nan")), "digest-max-age must be"),
            (
                dict(dp_routing_digest_publish_interval=-1.0),
                "publish-interval must be a finite number of seconds > 0",
            ),
            (
                dict(dp_routing_digest_publish_interval=float("inf")),
                "publish-interval must be a finite",
            ),
            (
                dict(dp_routing_pending_ttl=-0.5),
                r"pending-ttl must be a finite number of seconds >= 0 \(0 disables",
            ),
            (dict(dp_routing_pending_ttl=float("inf")), "pending-ttl must be a finite"),
        ):
            with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, msg):
                _resolve(dp_size=2, load_balance_method="cache_aware", **kwargs)

    def test_routing_flags_without_cache_aware_warn_once(self):
        hook = "sglang.srt.arg_groups.cache_aware_routing_hook"
        for kwargs, method in (
            (dict(load_balance_method="round_robin"), "round_robin"),
            ({}, "round_robin"),  # auto resolves to round_robin
            (dict(disaggregation_mode="prefill"), "follow_bootstrap_room"),
        ):
            with self.subTest(**kwargs), self.assertLogs(hook, "WARNING") as logs:
                resolved = _resolve(
                    dp_size=2,
                    page_size=1,
                    dp_routing_max_extra_reqs=3,
                    dp_routing_digest_chunk_size=64,
                    dp_routing_pending_ttl=0.0,
                    **kwargs,
                )
            self.assertEqual(resolved[0], method)
            self.assertEqual(len(logs.records), 1, logs.output)
            msg = logs.output[0]
            self.assertIn("--dp-routing-max-extra-reqs", msg)
            self.assertIn("--dp-routing-digest-chunk-size", msg)
            self.assertIn("--dp-routing-pending-ttl", msg)
            self.assertNotIn("--dp-routing-digest-max-age", msg)
            self.assertIn(method, msg)
        # Defaults (and cache_aware itself) warn about nothing.
        with self.assertNoLogs(hook, "WARNING"):
            _resolve(dp_size=2, page_size=1)
            _resolve(
                dp_size=2,
                page_size=1,
                load_balance_method="cache_aware",
                dp_routing_max_extra_reqs=3,
            )

    def test_auto_selection(self):
        self.assertEqual(_resolve(dp_size=2, page_size=1, **DECODE)[0], "cache_aware")
        self.assertEqual(
            _resolve(attn_dp_size=4, tp_size=4, page_size=1, **DECODE)[0],
            "cache_aware",
        )
        # Unchanged defaults elsewhere.
        self.assertEqual(_resolve(dp_size=1, page_size=1, **DECODE)[0], "round_robin")
        self.assertEqual(
            _resolve(dp_size=2, page_size=1, disaggregation_mode="decode")[0],
            "round_robin",
        )
        self.assertEqual(_resolve(dp_size=2, page_size=1)[0], "round_robin")
        self.assertEqual(
            _resolve(dp_size=2, page_size=1, disaggregation_mode="prefill")[0],
            "follow_bootstrap_room",
        )
        # Not auto-selected where it would be refused.
        self.assertEqual(
            _resolve(dp_size=2, page_size=1, nnodes=2, **DECODE)[0], "round_robin"
        )
        # An explicit method wins over auto-selection.
        self.assertEqual(
            _resolve(
                dp_size=2, page_size=1, load_balance_method="total_tokens", **DECODE
            )[0],
            "total_tokens",
        )

    def test_prefill_and_plain_dp_accept_it(self):
        self.assertEqual(
            _resolve(
                dp_size=2,
                page_size=1,
                disaggregation_mode="prefill",
                load_balance_method="cache_aware",
            )[0],
            "cache_aware",
        )
        self.assertEqual(
            _resolve(dp_size=2, page_size=1, load_balance_method="cache_aware")[0],
            "cache_aware",
        )

    def test_rejections(self):
        for kwargs, msg in (
            (dict(elastic_ep_backend="mooncake"), "elastic EP"),
            (dict(nnodes=2), "multi-node"),
            (
                dict(kv_events_config='{"publisher": "zmq", "format": "dynamo"}'),
                "Dynamo-format",
            ),
            (dict(disaggregation_mode="decode"), "disaggregation-decode-enable-radix"),
            (dict(disable_radix_cache=True), "requires the radix cache"),
        ):
            with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, msg):
                _resolve(
                    dp_size=2, page_size=1, load_balance_method="cache_aware", **kwargs
                )


if __name__ == "__main__":
    unittest.main()
