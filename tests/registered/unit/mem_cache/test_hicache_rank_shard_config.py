"""Rank-shard configuration: knob validation, the activation matrix, sizing.

Single process: the activation check reads the published configuration of a
real ``ServerArgs`` (tp_size=2, direct I/O, page_first_direct) and a real
``DSATokenToKVPool``; each condition alone must turn sharding off and be named.
Capacity is compared against upstream's own host-pool sizing (an allocator-only
``MLATokenToKVPoolHost``) for DeepSeek-V3.2 geometry and a small model.
"""

import math
import os
import unittest
from unittest import mock

import torch
from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.hicache_rank_shard_scenarios import (
    inactive_reasons,
    require_rank_shard,
)
from harness.stacks.dsa_hicache_stack import dsa_device_pool, publish_server_args

register_cpu_ci(est_time=40, suite="base-a-test-cpu")
FEATURE_GROUP = "hicache-rank-shard"  # the series group it tests (or "series")
LANDS_WITH = "0002"  # passes from this patch of the group on (pr-check runs it there)


def setUpModule():
    require_rank_shard()


class TestKnobs(unittest.TestCase):
    def test_bad_values_fail_naming_the_variable(self):
        from sglang.srt.mem_cache.hicache_rank_shard.config import (
            is_rank_shard_requested,
            read_rank_shard_settings,
        )

        cases = {
            "SGLANG_HICACHE_RANK_SHARD_STAGING_MB": [
                "abc",
                "0",
                "-4",
                "1.5",
                "1025",
                "1000000000",
            ],
            "SGLANG_HICACHE_RANK_SHARD_LOG_EVERY": ["x", "-1"],
            "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": ["", "-2"],
            "SGLANG_HICACHE_RANK_SHARD_KEEP_CAPACITY": ["maybe"],
        }
        for name, values in cases.items():
            for value in values:
                with mock.patch.dict(os.environ, {name: value}):
                    with self.assertRaises(ValueError, msg=(name, value)) as ctx:
                        read_rank_shard_settings()
                    self.assertIn(name, str(ctx.exception))
        with mock.patch.dict(os.environ, {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "on?"}):
            with self.assertRaises(ValueError) as ctx:
                is_rank_shard_requested()
            self.assertIn("SGLANG_ENABLE_HICACHE_RANK_SHARD", str(ctx.exception))

    def test_defaults_and_good_values(self):
        from sglang.srt.mem_cache.hicache_rank_shard.config import (
            read_rank_shard_settings,
        )

        with mock.patch.dict(os.environ, {}, clear=False):
            for k in list(os.environ):
                if k.startswith("SGLANG_HICACHE_RANK_SHARD"):
                    os.environ.pop(k)
            s = read_rank_shard_settings()
        self.assertEqual(
            (s.keep_capacity, s.staging_bytes, s.log_every, s.verify_every),
            (False, 128 << 20, 0, 0),
        )
        env = {
            "SGLANG_HICACHE_RANK_SHARD_STAGING_MB": "8",
            "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "3",
            "SGLANG_HICACHE_RANK_SHARD_KEEP_CAPACITY": "1",
        }
        with mock.patch.dict(os.environ, env):
            s = read_rank_shard_settings()
        self.assertEqual(
            (s.keep_capacity, s.staging_bytes, s.verify_every), (True, 8 << 20, 3)
        )


class TestActivationMatrix(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang.srt.runtime_context import reset_context

        # The published topology is process-wide: leave none behind.
        cls.addClassCleanup(reset_context)
        publish_server_args(0, 2)
        cls.pool = dsa_device_pool()

    def _reasons(self, pool=None):
        from sglang.srt.mem_cache.hicache_rank_shard.config import (
            rank_shard_inactive_reasons,
        )

        return rank_shard_inactive_reasons(pool or self.pool)

    def test_supported_configuration_has_no_reason(self):
        self.assertEqual(self._reasons(), [])

    def test_more_nodes_keep_it_on(self):
        # The exchange and the agreement are process-group collectives over the
        # shard group's ranks, wherever they run (live: a 2-node TP=2 launch in
        # server/test_hicache_rank_shard_server.py).
        from sglang.srt.runtime_context import get_parallel

        with get_parallel().override(nnodes=2):
            self.assertEqual(self._reasons(), [])

    def test_each_condition_alone_turns_it_off_and_is_named(self):
        from sglang.srt.runtime_context import get_memory, get_parallel

        # (a PD decode worker: test_hicache_rank_shard.py, from the patch that
        # shards it)
        cases = [
            (get_parallel, dict(pp_size=2), "pp_size=2"),
            (get_parallel, dict(dcp_enabled=True, attn_dcp_size=2), "(DCP)"),
            (
                get_parallel,
                dict(enable_kv_cache_sharding=True),
                "--enable-kv-cache-sharding",
            ),
            (
                get_memory,
                dict(hicache_io_backend="kernel"),
                "--hicache-io-backend kernel",
            ),
            (
                get_memory,
                dict(hicache_mem_layout="layer_first"),
                "--hicache-mem-layout layer_first",
            ),
            (
                get_memory,
                dict(hicache_storage_backend="hf3fs"),
                "--hicache-storage-backend hf3fs",
            ),
            (get_memory, dict(hicache_host_memory_mode="buffer_only"), "buffer_only"),
            (
                get_memory,
                dict(enable_linker_mla_dedup=True),
                "--enable-linker-mla-dedup",
            ),
            (get_memory, dict(enable_hisparse=True), "--enable-hisparse"),
        ]
        for bag, override, expected in cases:
            with bag().override(**override):
                reasons = self._reasons()
            self.assertEqual(len(reasons), 1, (override, reasons))
            self.assertIn(expected, reasons[0])

    def test_pool_conditions(self):
        # (plain MLA pools: tests/registered/unit/mem_cache/test_hicache_rank_shard.py,
        # from the patch that shards them on)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        mha = MHATokenToKVPool(
            size=256,
            page_size=64,
            dtype=torch.bfloat16,
            head_num=2,
            head_dim=64,
            layer_num=4,
            device="cpu",
            enable_memory_saver=False,
        )
        self.assertEqual(len(self._reasons(mha)), 1)
        self.assertIn("device KV pool is MHATokenToKVPool", self._reasons(mha)[0])
        # one KV layer per rank at least, and one live indexer layer per rank
        reasons = self._reasons(
            dsa_device_pool(layer_num=2, skip_topk_layers=[False, True])
        )
        self.assertEqual(len(reasons), 1)
        self.assertIn("fewer layers than ranks", reasons[0])

    def test_parallel_layouts_each_named(self):
        # A fresh process each: the parallel topology of a published config is
        # fixed for the process.
        for kwargs, expected in [
            (dict(tp_size=1), "tp_size=1"),
            (dict(tp_size=2, enable_dp_attention=True, dp_size=2), "DP attention"),
            (dict(tp_size=2, attn_cp_size=2), "attention CP"),
        ]:
            (reasons,) = run_ranks(inactive_reasons, 1, timeout=480, **kwargs)
            self.assertEqual(len(reasons), 1, (kwargs, reasons))
            self.assertIn(expected, reasons[0])


class TestCapacity(unittest.TestCase):
    """Sharded vs unsharded vs KEEP_CAPACITY at the same host memory."""

    ROW = 656  # DeepSeek-V3.2 FP8 latent row, bytes per token per layer
    PAGE = 64
    DEVICE_TOKENS = 1_000_000

    def _upstream_capacity(self, layers, ratio, size_gb):
        from sglang.srt.mem_cache.pool_host.mla import (
            MLAHostAllocation,
            MLATokenToKVPoolHost,
        )

        pool = MLATokenToKVPoolHost(
            MLAHostAllocation(
                dtype=torch.uint8,
                kv_lora_rank=512,
                qk_rope_head_dim=64,
                kv_cache_dim=self.ROW,
                size_per_token=self.ROW * layers,
            ),
            ratio,
            size_gb,
            self.PAGE,
            "page_first_direct",
            pin_memory=False,
            device="cpu",
            override_kv_cache_dim=self.ROW,
            device_capacity_tokens=self.DEVICE_TOKENS,
            start_layer=0,
            end_layer=layers,
            target_layer_num=layers,
        )
        return pool.size

    def test_capacity_grows_by_layers_over_owned_share(self):
        from sglang.srt.mem_cache.hicache_rank_shard.config import (
            rank_shard_host_token_capacity,
        )
        from sglang.srt.runtime_context import reset_context

        self.addCleanup(reset_context)
        publish_server_args(0, 2)
        for layers in (61, 5):
            for tp in (2, 4, 8):
                if layers < tp:
                    continue
                for ratio, size_gb in ((2.0, 0), (1.0, 100.0)):
                    upstream = self._upstream_capacity(layers, ratio, size_gb)
                    kw = dict(
                        device_capacity_tokens=self.DEVICE_TOKENS,
                        page_size=self.PAGE,
                        hicache_ratio=ratio,
                        hicache_size_gb=size_gb,
                        bytes_per_token_layer=self.ROW,
                        layer_num=layers,
                        tp_size=tp,
                    )
                    keep = rank_shard_host_token_capacity(**kw, keep_capacity=True)
                    sharded = rank_shard_host_token_capacity(**kw)
                    case = (layers, tp, ratio, size_gb)
                    self.assertEqual(keep, upstream, case)
                    owned = math.ceil(layers / tp)
                    self.assertAlmostEqual(
                        sharded / upstream, layers / owned, delta=0.01, msg=case
                    )
                    # the same host memory: the largest share fits in the budget
                    budget = upstream * self.ROW * layers
                    self.assertLessEqual(
                        (sharded - self.PAGE) * self.ROW * owned, budget, case
                    )
                    self.assertEqual(sharded % self.PAGE, 0)
                    # KEEP_CAPACITY uses about 1/tp of the memory
                    self.assertAlmostEqual(
                        keep * owned / (upstream * layers), owned / layers, delta=1e-3
                    )


if __name__ == "__main__":
    unittest.main()
