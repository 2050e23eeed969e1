"""Rank shard under DP attention: the shard group is the attention-TP group.

Four real processes (gloo) at ``--tp 4 --dp-size 2 --enable-dp-attention``:
two DP-attention groups of two attention-TP ranks. Each rank creates the
process groups a scheduler creates (upstream's ``init_distributed_environment``,
``initialize_model_parallel``, ``initialize_dp_attention``) and builds a real
``UnifiedRadixCache`` with HiCache over a plain MLA pool of 4 layers, given
the group a scheduler gives its cache (``get_dp_tp_group()``). The DP groups
cache prefixes of their own and load them back from the host tier through
``load_back`` / ``ready_to_load_host_cache`` (agreement and exchange
included): DP group 0 three times, DP group 1 once and then idle, every step
ending in an all-reduce over the whole TP group, as a DP-attention iteration
does.

Checks, from the geometry: each attention-TP rank r of 2 owns KV layers
[r, r + 2] and its group's ranks are its shard group; host capacity
device tokens x ratio x 4 / 2 (+ one page); restored rows bit-exact; each
rank broadcast exactly its owned layers' rows of its own group's load-backs
and received its peer's (counted on the tensors handed to ``dist.broadcast``);
an idle group broadcasts nothing and agrees on nothing. Negative control: the
shard group taken from the full TP group (4 ranks) fails them. Activation: an
attention-TP size of 1 is refused with one reason; the layer-count check uses
the attention-TP size.
"""

import math
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import RankFailure, run_ranks
from harness.scenarios.hicache_rank_shard_scenarios import (
    dp_attention_load_backs,
    inactive_reasons_by_pool,
    require_rank_shard,
)

register_cpu_ci(est_time=90, suite="base-a-test-cpu")
FEATURE_GROUP = "hicache-rank-shard"  # the series group it tests (or "series")
LANDS_WITH = "0012"  # passes from this patch of the group on (pr-check runs it there)

ON = {
    "SGLANG_ENABLE_HICACHE_RANK_SHARD": "1",
    "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "1",
    "SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S": "60",
}
TP, DP, LAYERS = 4, 2, 4
ATTN_TP = TP // DP
LOADS = (3, 1)  # load-backs of DP group 0 and 1
TOKENS = 64  # tokens of each cached prefix (page-aligned: page 16)
DEVICE_TOKENS, RATIO, PAGE = 1024, 2.0, 16  # the decode stack's pool and ratio


def setUpModule():
    require_rank_shard()


def run(**kwargs):
    return run_ranks(
        dp_attention_load_backs,
        TP,
        timeout=600,
        env=ON,
        dp_size=DP,
        layer_num=LAYERS,
        loads_by_group=LOADS,
        tokens=TOKENS,
        **kwargs,
    )


class TestRankShardDpAttentionGroups(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = run()

    def check_groups(self, results):
        for r in results:
            rank = r["rank"]
            group, attn_tp_rank = rank // ATTN_TP, rank % ATTN_TP
            self.assertEqual(
                (r["attn_dp_rank"], r["attn_tp"]), (group, (attn_tp_rank, ATTN_TP))
            )
            self.assertTrue(r["sharded"], rank)
            self.assertEqual(
                (r["shard_rank"], r["shard_size"], r["group_ranks"]),
                (attn_tp_rank, ATTN_TP, [group * ATTN_TP + i for i in range(ATTN_TP)]),
                rank,
            )
            self.assertEqual(
                r["kv_host_layers"], list(range(LAYERS))[attn_tp_rank::ATTN_TP], rank
            )
            # ratio x the device KV bytes, held as this rank's share of the layers
            owned = math.ceil(LAYERS / ATTN_TP)
            capacity = int(DEVICE_TOKENS * RATIO * LAYERS / owned) // PAGE * PAGE
            self.assertEqual(r["kv_host_size"], capacity + PAGE, rank)

    def check_loads(self, results):
        for r in results:
            rank, group = r["rank"], r["attn_dp_rank"]
            self.assertGreaterEqual(r["evicted"], TOKENS * max(LOADS), rank)
            self.assertEqual(
                r["loads"],
                [dict(loaded=True, host_hit=TOKENS, device_after=TOKENS, exact=True)]
                * LOADS[group],
                rank,
            )

    def check_wire(self, results):
        for r in results:
            rank, group = r["rank"], r["attn_dp_rank"]
            # this rank's layers of each of its group's load-backs out, its
            # peer's in; nothing while its group idles
            owned = len(range(LAYERS)[rank % ATTN_TP :: ATTN_TP])
            mine = LOADS[group] * TOKENS * r["row_bytes"] * owned
            theirs = LOADS[group] * TOKENS * r["row_bytes"] * (LAYERS - owned)
            self.assertEqual((r["wire_sent"], r["wire_received"]), (mine, theirs), rank)
            self.assertEqual((r["bytes_sent"], r["bytes_received"]), (mine, theirs))
            steps = r["broadcasts_per_step"]
            self.assertTrue(all(n > 0 for n in steps[: LOADS[group]]), (rank, steps))
            self.assertEqual(steps[LOADS[group] :], [0] * (max(LOADS) - LOADS[group]))
            self.assertEqual(r["decisions"], LOADS[group], rank)

    def test_each_attention_tp_group_is_a_shard_group(self):
        self.check_groups(self.results)

    def test_load_backs_restore_each_groups_own_rows(self):
        self.check_loads(self.results)

    def test_each_rank_broadcasts_its_layers_within_its_group(self):
        self.check_wire(self.results)

    def test_shard_group_over_the_full_tp_group_fails_the_checks(self):
        # Negative control: four shard ranks (1 layer each, the other DP
        # group's rows broadcast in). Once every vote of the group is tagged
        # and carries each rank's tree digest (hicache-rank-shard 0014), the
        # two DP groups' different trees stop the run at its first vote;
        # before, it ran and the checks fail.
        try:
            broken = run(shard_over_full_tp=True)
        except RankFailure as e:
            self.assertIn("RankShardDivergence", str(e))
            self.assertIn("the radix trees of shard group [0, 1, 2, 3] differ", str(e))
            return
        for check in (self.check_groups, self.check_loads, self.check_wire):
            with self.assertRaises(AssertionError, msg=check.__name__):
                check(broken)


class TestRankShardDpAttentionActivation(unittest.TestCase):
    def test_attention_tp_size_one_is_refused_with_one_reason(self):
        (reasons,) = run_ranks(
            inactive_reasons_by_pool,
            1,
            timeout=480,
            tp_size=2,
            dp_size=2,
            enable_dp_attention=True,
            pools=[(4, 4)],
        )
        self.assertEqual(len(reasons[0]), 1, reasons)
        self.assertIn("attention-TP size 1 under DP attention", reasons[0][0])
        self.assertIn("nothing replicated", reasons[0][0])

    def test_layer_counts_use_the_attention_tp_size(self):
        (reasons,) = run_ranks(
            inactive_reasons_by_pool,
            1,
            timeout=480,
            tp_size=TP,
            dp_size=DP,
            enable_dp_attention=True,
            pools=[(4, 4), (2, 2), (2, 1)],
        )
        # 2 KV and 2 indexer layers are enough for 2 attention-TP ranks
        # (not for 4 TP ranks); one live indexer layer is not.
        self.assertEqual(reasons[:2], [[], []])
        self.assertEqual(len(reasons[2]), 1, reasons)
        self.assertIn("fewer layers than ranks", reasons[2][0])
        self.assertIn("attention-TP 2", reasons[2][0])


class TestRankShardDpAttentionGroupGuard(unittest.TestCase):
    def test_a_cache_group_other_than_the_attention_tp_group_fails_at_startup(self):
        # The plan given the full TP group as the cache's group (as a cache
        # builder passing get_tp_group() would): no shard group of the wrong
        # size is created, startup fails naming the ranks.
        with self.assertRaises(RankFailure) as ctx:
            run(cache_over_full_tp=True)
        self.assertIn("the cache's TP group has ranks [0, 1, 2, 3]", str(ctx.exception))
        self.assertIn("but 2 ranks hold the same KV", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
