"""Rank-sharded HiCache host tier (SGLANG_ENABLE_HICACHE_RANK_SHARD) on CPU.

Real processes (one per TP rank, gloo), DSA stacks built through upstream's
``_DsaStrategy.build`` and plain MLA stacks (DeepSeek-V3 / R1, Kimi-K2)
through ``_PlainKvStrategy.build``, with the patched modules; only the two
direct ``kvcacheio`` ops and pinned-memory registration are stand-ins.
"""

import math
import os
import unittest
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import RankFailure, run_ranks
from harness.scenarios.hicache_rank_shard_scenarios import (
    decode_restores,
    exchange_without_peer,
    load_back_agreement,
    mismatched_votes,
    require_rank_shard,
    sharded_roundtrip,
    vote_without_peer,
)
from harness.stacks.dsa_hicache_stack import dsa_device_pool, publish_server_args

register_cpu_ci(est_time=300, suite="base-a-test-cpu")
FEATURE_GROUP = "hicache-rank-shard"  # the series group it tests (or "series")

ON = {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "1"}
KV_ROW_BYTES = 576 * 2  # bf16 latent + rope row of the test pool
INDEXER_ROW_BYTES = 132 * 64  # one 64-token indexer page


def setUpModule():
    require_rank_shard()


def _device_layers(trace, op, kind):
    """Device layers a rank's transfer calls touched, per direction."""
    side = "src" if op == "d2h_all_layer" else "dst"
    layers = set()
    for call in trace:
        if call["op"] != op:
            continue
        for name in call[side]:
            if name.startswith(f"device.{kind}["):
                layers.add(int(name[len(f"device.{kind}[") : -1]))
    return layers


def _owned_load_bytes(results, r) -> int:
    """Bytes rank ``r`` owns of every load-back the run made: the loaded tokens
    (the events every rank shares) times its KV layers' row bytes, plus the
    loaded pages times its indexer layers' page bytes."""
    tokens = sum(
        len(e[2])
        for e in results[0]["events"]
        if e[0] == "load" and isinstance(e[2], list)
    )
    assert tokens > 0 and tokens % 64 == 0, tokens
    kv = tokens * KV_ROW_BYTES * len(r["kv_host_layers"])
    return kv + tokens // 64 * INDEXER_ROW_BYTES * len(r["indexer_host_layers"])


class _ShardedRun:
    WORLD = 4
    LAYERS = 7
    SKIP = None
    MODEL = "dsa"
    DEVICE_TOKENS, RATIO, PAGE = 1024, 2.0, 64  # the scenario's pool, hicache ratio

    @classmethod
    def setUpClass(cls):
        if cls.MODEL == "mla":
            cls.skip = (True,) * cls.LAYERS  # no indexer
        else:
            cls.skip = cls.SKIP or (False,) * cls.LAYERS
        cls.results = run_ranks(
            sharded_roundtrip,
            cls.WORLD,
            timeout=1200,
            env={
                **ON,
                "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "2",
                "SGLANG_HICACHE_RANK_SHARD_LOG_EVERY": "3",
            },
            seed=3,
            steps=36,
            layer_num=cls.LAYERS,
            skip_topk_layers=cls.skip,
            count_groups=True,
            model=cls.MODEL,
        )

    def assert_sharded(self):
        """The run was sharded: every rank's host pool is a sharded one that
        holds only its round-robin share of the KV layers (byte checks that
        would hold on a replicated host tier prove nothing without it)."""
        for r in self.results:
            self.assertTrue(r["sharded"], f"rank {r['rank']}: host tier not sharded")
            self.assertEqual(
                r["kv_host_layers"], list(range(self.LAYERS))[r["rank"] :: self.WORLD]
            )

    def test_every_rank_is_sharded_with_round_robin_owners(self):
        self.assert_sharded()
        live = [i for i, s in enumerate(self.skip) if not s]
        counts = []
        for r in self.results:
            self.assertTrue(r["sharded"])
            # allocated when the host tier is attached, not at the first load
            self.assertEqual(r["staging_at_start"], 128 << 20)
            self.assertEqual(r["groups_created"], 2)  # broadcast + verify group
            self.assertEqual(
                r["kv_host_layers"], list(range(self.LAYERS))[r["rank"] :: self.WORLD]
            )
            self.assertEqual(r["indexer_host_layers"], live[r["rank"] :: self.WORLD])
            counts.append(len(r["kv_host_layers"]))
        self.assertLessEqual(max(counts) - min(counts), 1)
        self.assertEqual(sum(counts), self.LAYERS)

    def test_restores_are_bit_exact_on_every_rank(self):
        self.assert_sharded()
        loads = [
            e
            for e in self.results[0]["events"]
            if e[0] == "load" and isinstance(e[2], list)
        ]
        self.assertGreaterEqual(len(loads), 5)
        for r in self.results:
            self.assertEqual(r["mismatches"], [], f"rank {r['rank']}")

    def test_host_indices_and_capacity_identical_across_ranks(self):
        self.assert_sharded()
        for r in self.results[1:]:
            self.assertEqual(r["events"], self.results[0]["events"])
            self.assertEqual(r["kv_host_size"], self.results[0]["kv_host_size"])

    def test_host_capacity_grows_by_the_layer_share(self):
        # The same host memory as the replicated tier (ratio x device KV bytes)
        # holds layers / ceil(layers / tp) times the tokens, plus the padding
        # page of the unsharded sizing; each rank's buffer holds its layers.
        per_rank = math.ceil(self.LAYERS / self.WORLD)
        tokens = int(self.DEVICE_TOKENS * self.RATIO * self.LAYERS / per_rank)
        expected = (tokens // self.PAGE + 1) * self.PAGE
        for r in self.results:
            self.assertEqual(r["kv_host_size"], expected)
            owned = len(r["kv_host_layers"])
            self.assertEqual(r["kv_host_bytes"], expected * owned * 576, r["rank"])

    def test_host_copies_touch_only_owned_layers_with_owned_bytes(self):
        for r in self.results:
            owned_kv = set(r["kv_host_layers"])
            owned_ix = set(r["indexer_host_layers"])
            for op in ("d2h_all_layer", "h2d_layer"):
                self.assertEqual(_device_layers(r["trace"], op, "kv"), owned_kv, op)
                self.assertEqual(
                    _device_layers(r["trace"], op, "indexer"), owned_ix, op
                )
            # D2H bytes: every backed-up token, once per owned layer.
            tokens = sum(
                len(c["src_pages"]) * 64
                for c in r["trace"]
                if c["op"] == "d2h_all_layer" and c["dst"] == ("host.kv",)
            )
            kv_bytes = sum(
                c["nbytes"]
                for c in r["trace"]
                if c["op"] == "d2h_all_layer" and c["dst"] == ("host.kv",)
            )
            self.assertEqual(kv_bytes, tokens * KV_ROW_BYTES * len(owned_kv))
            # Broadcast volume, from the geometry: per loaded token one KV row
            # of each layer the rank owns, per loaded page one indexer page of
            # each indexer layer it owns. That is what it copies host->device,
            # what it hands to dist.broadcast, and what the exchange counts.
            self.assertEqual(r["bytes_sent"], _owned_load_bytes(self.results, r))
            h2d = sum(c["nbytes"] for c in r["trace"] if c["op"] == "h2d_layer")
            self.assertEqual(h2d, r["bytes_sent"], r["rank"])
            self.assertEqual(r["wire_sent"], r["bytes_sent"], r["rank"])
        for r in self.results:  # and receives what every other rank sent
            others = sum(_owned_load_bytes(self.results, o) for o in self.results)
            others -= _owned_load_bytes(self.results, r)
            self.assertEqual(r["bytes_received"], others, r["rank"])
            self.assertEqual(r["wire_received"], others, r["rank"])
        self.assertTrue(all(r["gate_event_set"] for r in self.results))

    def test_one_broadcast_per_layer_owner(self):
        """KV and indexer rows of a layer with one owner share one broadcast
        (the staging holds both here); a layer whose indexer layer has
        another owner broadcasts once per owner."""
        from sglang.srt.mem_cache.hicache_rank_shard.config import layer_owners

        live = [i for i, s in enumerate(self.skip) if not s]
        kv = layer_owners(range(self.LAYERS), self.WORLD)
        ix = layer_owners(live, self.WORLD)
        per_load = sum(
            len({kv[l]} | ({ix[l]} if l in ix else set())) for l in range(self.LAYERS)
        )
        if self.MODEL == "dsa":
            self.assertGreater(per_load, self.LAYERS)  # the skip moves some owners
        else:
            self.assertEqual(per_load, self.LAYERS)  # one owner per layer
        events = self.results[0]["events"]
        loads = sum(1 for e in events if e[0] == "load" and isinstance(e[2], list))
        for r in self.results:
            self.assertEqual(r["broadcasts"], loads * per_load, f"rank {r['rank']}")

    def test_sharded_pools_address_their_own_pages_for_zero_copy_l3(self):
        # A sharded pool's zero-copy page buffer meta (what Mooncake puts from
        # and gets into) addresses exactly its own page: a random page written
        # through the flat accessor (the file backend's) reads back byte for
        # byte through the meta's pointers, and the meta covers the page's
        # bytes, this rank's layers only; what registers a pool as whole-layer
        # slabs (the PD transfer engine's) stays refused by its class, and so
        # does attaching a storage backend the tier does not cover, naming it.
        names = {"RankShardedMLATokenToKVPoolHost"}
        if self.MODEL == "dsa":
            names.add("RankShardedDSAIndexerPoolHost")
        for r in self.results:
            l3 = r["l3_page_access"]
            self.assertEqual(set(l3["pools"]), names)
            has = l3["pools"]["RankShardedMLATokenToKVPoolHost"]["has"]
            self.assertEqual(has, ["get_contiguous_buf_infos"])
            for pool in l3["pools"].values():
                self.assertEqual(pool["refused"], pool["has"])
                self.assertTrue(pool["flat"])
                self.assertTrue(pool["flat_bytes"])
                self.assertEqual(pool["meta_bytes"], pool["page_bytes"])
                self.assertTrue(pool["meta_is_page"], "meta addresses another page")
            self.assertIn(
                "--hicache-storage-backend nixl (rank-sharded L3 covers only "
                "file, mooncake",
                l3["attach_storage_backend"],
            )

    def test_periodic_log_reports_this_ranks_counts(self):
        events = self.results[0]["events"]
        loads = sum(1 for e in events if e[0] == "load" and isinstance(e[2], list))
        for r in self.results:
            lines = [m for m in r["log"] if m.startswith("HiCache rank shard [rank")]
            self.assertEqual(len(lines), loads // 3, r["log"])
            self.assertIn(f"[rank {r['rank']}]: {loads // 3 * 3} loads", lines[-1])
            self.assertIn("GB copied host->device by this rank", lines[-1])


class TestRankShardFourRanks(_ShardedRun, unittest.TestCase):
    WORLD = 4
    LAYERS = 7  # not divisible by 4
    SKIP = (False, False, True, False, False, False, False)


class TestRankShardEightRanks(_ShardedRun, unittest.TestCase):
    WORLD = 8
    LAYERS = 11  # not divisible by 8; 9 live indexer layers
    SKIP = (False, True, False, False, False, True, False, False, False, False, False)


class TestRankShardMlaTwoRanks(_ShardedRun, unittest.TestCase):
    MODEL = "mla"
    WORLD = 2
    LAYERS = 5


class TestRankShardMlaFourRanks(_ShardedRun, unittest.TestCase):
    MODEL = "mla"
    WORLD = 4
    LAYERS = 7


class TestRankShardMlaEightRanks(_ShardedRun, unittest.TestCase):
    MODEL = "mla"
    WORLD = 8
    LAYERS = 11


class TestRankShardChunkedStaging(unittest.TestCase):
    def test_layers_larger_than_staging_restore_exactly(self):
        # 3 indexer pages or 22 KV rows per broadcast: loads of up to 4 pages
        # go out in 2 indexer and up to 12 KV chunks per layer.
        results = run_ranks(
            sharded_roundtrip,
            2,
            timeout=900,
            env=ON,
            seed=11,
            steps=20,
            layer_num=5,
            staging_bytes=3 * INDEXER_ROW_BYTES,
        )
        loads = [
            e for e in results[0]["events"] if e[0] == "load" and isinstance(e[2], list)
        ]
        self.assertTrue(any(len(e[2]) > 3 * 64 for e in loads))
        for r in results:
            self.assertTrue(r["sharded"])
            self.assertEqual(r["mismatches"], [], f"rank {r['rank']}")
        self.assertEqual(results[1]["bytes_received"], results[0]["bytes_sent"])
        self.assertEqual(results[0]["bytes_received"], results[1]["bytes_sent"])


class TestRankShardPlanInactive(unittest.TestCase):
    """With the flag set but a condition failing, the plan is not made: one
    warning names every failing condition, and no group is created."""

    @classmethod
    def setUpClass(cls):
        from sglang.srt.runtime_context import reset_context

        # The published topology is process-wide: leave none behind.
        cls.addClassCleanup(reset_context)
        publish_server_args(0, 2)
        cls.pool = dsa_device_pool()

    def test_flag_set_but_inactive_logs_every_reason_and_creates_nothing(self):
        from sglang.srt.mem_cache.hicache_rank_shard.plan import maybe_plan_rank_shard
        from sglang.srt.runtime_context import get_memory

        params = mock.sentinel.params  # never touched: no group is created
        with mock.patch.dict(os.environ, {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "1"}):
            with get_memory().override(
                hicache_io_backend="kernel", enable_hisparse=True
            ):
                with self.assertLogs(
                    "sglang.srt.mem_cache.hicache_rank_shard", "WARNING"
                ) as logs:
                    self.assertIsNone(
                        maybe_plan_rank_shard(kvcache=self.pool, params=params)
                    )
        self.assertEqual(len(logs.records), 1)
        self.assertIn("--hicache-io-backend kernel", logs.output[0])
        self.assertIn("--enable-hisparse", logs.output[0])
        with mock.patch.dict(os.environ, {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "0"}):
            self.assertIsNone(maybe_plan_rank_shard(kvcache=self.pool, params=params))

    def test_plain_mla_pools_qualify(self):
        from sglang.srt.mem_cache.hicache_rank_shard.config import (
            rank_shard_inactive_reasons,
        )

        from harness.stacks.dsa_hicache_stack import mla_device_pool

        self.assertEqual(rank_shard_inactive_reasons(mla_device_pool(layer_num=4)), [])
        reasons = rank_shard_inactive_reasons(mla_device_pool(layer_num=1))
        self.assertEqual(len(reasons), 1, reasons)
        self.assertIn("fewer layers than ranks (KV 1, tp 2)", reasons[0])

    def test_unsupported_stacks_and_no_hicache_log_one_reason(self):
        from sglang.srt.mem_cache.hicache_rank_shard.config import (
            log_rank_shard_without_hicache,
        )
        from sglang.srt.mem_cache.hicache_rank_shard.plan import (
            log_rank_shard_unsupported,
        )

        with mock.patch.dict(os.environ, {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "1"}):
            with self.assertLogs(
                "sglang.srt.mem_cache.hicache_rank_shard", "WARNING"
            ) as logs:
                log_rank_shard_unsupported("_SwaStrategy")
                log_rank_shard_without_hicache()
        self.assertEqual(len(logs.records), 2, logs.output)
        self.assertIn(
            "the _SwaStrategy HiCache stack is not rank-sharded", logs.output[0]
        )
        self.assertIn("--enable-hierarchical-cache is off", logs.output[1])
        with mock.patch.dict(os.environ, {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "0"}):
            with self.assertNoLogs("sglang.srt.mem_cache.hicache_rank_shard"):
                log_rank_shard_unsupported("_SwaStrategy")
                log_rank_shard_without_hicache()


def run_ranks_together(scenario, what, env, **kwargs):
    """Two ranks of ``scenario`` with a short exchange wait. A rank stuck in
    a broadcast or vote its peer never joins, or whose votes or tree differ
    from its peer's, ends the scenario with the shard group's own report
    (``parted``): that fails the test here, by its assertion, naming
    ``what`` (its peer, left alone in a collective, may fail after it: that
    failure is named too). A failure of the run without such a report (a
    crash, a timeout, an assert of sglang) stays the ``RankFailure`` error
    it is."""
    env = {"SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S": "30", **env}
    then = ""
    try:
        results = run_ranks(scenario, 2, timeout=600, env=env, **kwargs)
    except RankFailure as e:
        results, then = list(e.results.values()), f"; then {e}"
        if not any(r["parted"] for r in results):
            raise
    parted = [f"rank {r['rank']}: {r['parted']}" for r in results if r["parted"]]
    if parted:
        raise AssertionError(
            f"the ranks did not take the {what} together: "
            + "; ".join(parted)
            + then[:2000]
        )
    return results


def run_ranks_agreeing(env=None, **kwargs):
    env = {**ON, **(env or {})}
    return run_ranks_together(load_back_agreement, "load-backs", env, **kwargs)


class TestRankShardLoadBackAgreement(unittest.TestCase):
    """The ranks of a shard group decide each load-back together (the radix
    cache's load_back through UnifiedRadixCache, TP=2, plain MLA: 2 layers,
    one owned per rank, rows of 64 + 16 bf16)."""

    TOKENS = 64
    ROW_BYTES = (64 + 16) * 2

    def test_a_load_back_one_rank_cannot_fit_is_a_miss_on_every_rank(self):
        # Rank 1's device pool reads full for the second of three load-backs.
        # Without the agreement rank 0 loads it alone and waits in its
        # exchange for a peer that never comes (bounded here by the exchange
        # timeout, else by the test's).
        self.check(run_ranks_agreeing())

    def test_the_test_only_variables_make_the_same_refusal(self):
        # SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_*: rank 1 refuses every
        # second load-back (the live server's way to inject it).
        knob = {
            "SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_RANK": "1",
            "SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_EVERY": "2",
        }
        self.check(run_ranks_agreeing(knob, refuse_rank=None))

    def test_each_divergence_point_is_decided_by_the_group(self):
        # SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_POINT: rank 1 diverges on
        # the second load-back at each point a rank decides alone. Going by
        # its own verdict, below its own threshold, or with its own
        # allocation, rank 0 would load alone and wait in its exchange; with
        # its own eviction (its pool reads as full), rank 1 would evict a node
        # rank 0 keeps on the device, and the trees would part.
        for point, loaded in (
            ("fit", [True, False, True]),
            ("threshold", [True, False, True]),
            ("alloc", [True, False, True]),
            ("evict", [True, True, True]),
        ):
            with self.subTest(point=point):
                knob = {
                    "SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_RANK": "1",
                    "SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_EVERY": "2",
                    "SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_POINT": point,
                }
                self.check(run_ranks_agreeing(knob, refuse_rank=None), loaded)

    def test_a_vote_on_another_path_fails_on_every_rank_naming_both_votes(self):
        # Rank 0 votes on a load-back, rank 1 on a decode restore: the two
        # collectives must not pair (each vote is tagged with its kind, number
        # and count); both ranks raise at once.
        results = run_ranks(mismatched_votes, 2, timeout=600, env=ON)
        for r in results:
            self.assertEqual(r["error_type"], "RankShardDivergence", r)
            self.assertIn(
                "entered different votes: shard rank 0: plan_load_back #0 of 4 "
                "value(s), shard rank 1: agree_each (decode restores) #0 of 1 "
                "value(s)",
                r["error"],
            )
            self.assertIsNone(r["result"], r)
            self.assertLess(r["seconds"], 30, r)

    def test_verified_ranks_whose_trees_parted_stop_at_the_next_vote(self):
        # SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY on (as the live tests run):
        # each load-back vote carries a digest of every rank's radix tree.
        # Rank 1 skips the eviction the group agreed on the second load-back
        # (a stand-in for any rank-local tree change): the third load-back's
        # vote stops both ranks, naming the digests, instead of loading on
        # trees that differ.
        env = {**ON, "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "1"}
        results = run_ranks(
            load_back_agreement, 2, timeout=600, env=env, refuser_evicts=False
        )
        for r in results:
            self.assertIn(
                "RankShardDivergence: HiCache rank shard: the radix trees of shard "
                "group [0, 1] differ before load-back vote #4",
                r["parted"] or "",
                r,
            )
        # the same run with the eviction on every rank loads as planned
        self.check(run_ranks_agreeing(env))

    def test_the_rust_tree_core_is_verified_too(self):
        # The servers' default tree core does not expose its nodes: its
        # digest is what its interface tells (device token positions, sizes,
        # free host slots). Trees that parted stop both ranks at the next
        # vote as on the Python core; trees that did not part never do, and
        # end with equal digests (check compares each rank's tree).
        env = {**ON, "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "1"}
        rust = dict(tree_core="rust")
        results = run_ranks(
            load_back_agreement, 2, timeout=600, env=env, refuser_evicts=False, **rust
        )
        for r in results:
            self.assertIn(
                "the radix trees of shard group [0, 1] differ before load-back "
                "vote #4",
                r["parted"] or "",
                r,
            )
        self.check(run_ranks_agreeing(env, **rust))

    def test_a_vote_no_peer_joins_fails_naming_the_vote_and_ranks(self):
        env = {**ON, "SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S": "2"}
        results = run_ranks(vote_without_peer, 2, timeout=600, env=env)
        voter = results[0]
        self.assertIn(
            "vote plan_load_back #0 of shard rank 0 (global rank 0) of ranks "
            "[0, 1] failed, waiting at most 2 s "
            "(SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S)",
            voter["error"] or "",
        )
        self.assertLess(voter["seconds"], 60, voter)
        self.assertIsNone(results[1]["error"])

    def check(self, results, loaded=(True, False, True)):
        loaded = list(loaded)
        missed = loaded.count(False)
        for r in results:
            self.assertTrue(r["sharded"], r)
            self.assertEqual(r["evicted"], 3 * self.TOKENS, r)
            self.assertEqual([l["loaded"] for l in r["loads"]], loaded, r)
            for load in r["loads"]:
                self.assertEqual(load["host_hit"], self.TOKENS, r)
            # the loads that ran restore every row bit for bit; a refused one
            # stays on host (a miss, recomputed by its request)
            exact = [True if ok else None for ok in loaded]
            self.assertEqual([l["exact"] for l in r["loads"]], exact, r)
            if not loaded[1]:
                self.assertEqual(r["loads"][1]["device_after"], 0, r)
            self.assertEqual(
                (r["split"], r["tokens_missed"]), (missed, missed * self.TOKENS), r
            )
            # each rank received its peer's layer of the loads that ran
            self.assertEqual(
                r["bytes_received"], loaded.count(True) * self.TOKENS * self.ROW_BYTES
            )
            self.assertEqual(r["queued"], 0, r)  # nothing left queued on any rank
        # every rank took the same decisions: the same radix tree, node for
        # node (paths, device row counts, host slots)
        trees = [r["tree"] for r in results]
        self.assertTrue(
            all(tree == trees[0] for tree in trees), "the ranks' radix trees differ"
        )

    def test_a_broadcast_no_peer_joins_fails_naming_the_layer_and_ranks(self):
        env = {**ON, "SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S": "2"}
        results = run_ranks(exchange_without_peer, 2, timeout=600, env=env)
        loader = results[0]
        self.assertTrue(loader["sharded"], loader)
        self.assertIn(
            "the broadcast of layer 0 from shard rank 0 (global rank 0) failed on "
            "shard rank 0 of ranks [0, 1], waiting at most 2 s",
            loader["error"] or "",
        )
        self.assertLess(loader["seconds"], 60, loader)
        self.assertIsNone(results[1]["error"])

    def test_the_refusing_rank_must_be_a_shard_rank(self):
        env = {**ON, "SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_RANK": "2"}
        with self.assertRaises(RankFailure) as ctx:
            run_ranks(load_back_agreement, 2, timeout=600, env=env)
        self.assertIn(
            "SGLANG_TEST_HICACHE_RANK_SHARD_REFUSE_LOAD_RANK must be a shard rank "
            "below 2 or -1, got 2",
            str(ctx.exception),
        )


class TestRankShardDecodeWorker(unittest.TestCase):
    """A PD decode worker qualifies: its restores load through start_loading
    (fenced, agreed by the shard group); a host-pool retraction restore
    copies every layer outside it, and is refused with its flag named."""

    @classmethod
    def setUpClass(cls):
        from sglang.srt.runtime_context import reset_context

        # The published topology is process-wide: leave none behind.
        cls.addClassCleanup(reset_context)
        publish_server_args(0, 2)
        cls.pool = dsa_device_pool()

    def _reasons(self, **disagg):
        from sglang.srt.mem_cache.hicache_rank_shard.config import (
            rank_shard_inactive_reasons,
        )
        from sglang.srt.runtime_context import get_disagg

        decode = dict(
            disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True
        )
        with get_disagg().override(**decode, **disagg):
            return rank_shard_inactive_reasons(self.pool)

    def test_a_pd_decode_worker_qualifies(self):
        for backup in (None, "cpu_tensor"):
            self.assertEqual(
                self._reasons(disaggregation_decode_retraction_backup=backup),
                [],
                backup,
            )

    def test_host_pool_retraction_is_refused_naming_the_flag(self):
        reasons = self._reasons(disaggregation_decode_retraction_backup="host_pool")
        self.assertEqual(len(reasons), 1, reasons)
        self.assertIn("--disaggregation-decode-retraction-backup host_pool", reasons[0])


def run_decode_restores(env, **kwargs):
    return run_ranks_together(decode_restores, "decode restores", env, **kwargs)


class TestRankShardDecodeRestores(unittest.TestCase):
    """A PD decode worker's restores at TP=2, through the real decode queues
    (admission, then the transfer queue's restore state machine) over
    UnifiedRadixCache with plain MLA: 4 layers, 2 owned per rank, rows of
    64 + 16 bf16; four 64-token prefixes restored from host one at a time
    (decode_restores: the second refused by rank 1's device pool, the third
    failing on rank 1 after its load-back was agreed). The same run on a
    replicated host tier is the reference."""

    TOKENS, LAYERS, WORLD = 64, 4, 2
    ROW_BYTES = (64 + 16) * 2

    runs: dict = {}

    def _run(self, name, env):
        """Each run once, in the first test that reads it, so that ranks that
        do not restore together fail the tests by assertion (each test with
        the first run's error)."""
        if name not in self.runs:
            try:
                self.runs[name] = run_decode_restores(env)
            except AssertionError as e:
                self.runs[name] = e
        if isinstance(self.runs[name], AssertionError):
            raise AssertionError(str(self.runs[name]))
        return self.runs[name]

    @property
    def sharded(self):
        return self._run("sharded", ON)

    @property
    def replicated(self):
        return self._run("replicated", {})

    def test_the_decode_host_tier_holds_only_owned_layers(self):
        for r in self.sharded:
            self.assertTrue(r["sharded"], r)
            owned = list(range(self.LAYERS))[r["rank"] :: self.WORLD]
            self.assertEqual(r["kv_host_layers"], owned, r)
            self.assertEqual(r["kv_host_layer_num"], len(owned), r)
            self.assertEqual(
                r["kv_host_bytes"], r["kv_host_size"] * len(owned) * self.ROW_BYTES
            )
        for r in self.replicated:
            self.assertFalse(r["sharded"], r)
            self.assertEqual(r["kv_host_layers"], list(range(self.LAYERS)), r)

    def test_restores_are_bit_exact_and_equal_the_replicated_ones(self):
        for run in (self.sharded, self.replicated):
            for r in run:
                self.assertEqual(r["evicted"], 4 * self.TOKENS, r)
                for i in (0, 3):
                    restore = r["restores"][i]
                    self.assertEqual(restore["promised"], self.TOKENS, (i, r))
                    self.assertEqual(restore["status"], "ready", (i, r))
                    self.assertIs(restore["exact"], True, (i, r))
        for i in (0, 3):
            digests = {r["restores"][i]["digest"] for r in self.sharded}
            digests |= {r["restores"][i]["digest"] for r in self.replicated}
            self.assertEqual(len(digests), 1, (i, digests))

    def test_a_restore_one_rank_cannot_fit_fails_on_both_ranks(self):
        for r in self.sharded:
            self.assertEqual(r["restores"][1]["status"], "failed", r)
            self.assertEqual(r["split"], 1, r)  # the load-back's agreement
        # replicated, each rank decides alone (the KV poll's all-reduce fails
        # the request on both in a server)
        statuses = [r["restores"][1]["status"] for r in self.replicated]
        self.assertEqual(statuses, ["ready", "failed"])

    def test_a_restore_failing_on_one_rank_after_its_load_fails_on_both(self):
        check_restore_failing_after_its_load(self, self.sharded)
        # the load the group queued for it started at once on both ranks (not
        # with the next restore): nothing stays queued once it failed
        for r in self.sharded:
            self.assertEqual(r["restores"][2]["queued_after"], 0, r)
        # every load that was queued ran on both ranks, the third's included:
        # each rank received its peer's two layers of loads 0, 2 and 3
        for r in self.sharded:
            self.assertEqual(
                r["bytes_received"], 3 * self.TOKENS * 2 * self.ROW_BYTES, r
            )

    def test_the_ranks_radix_trees_are_identical_afterwards(self):
        trees = [r["tree"] for r in self.sharded]
        self.assertTrue(
            all(tree == trees[0] for tree in trees), "the ranks' radix trees differ"
        )


def check_restore_failing_after_its_load(test, results):
    for r in results:
        test.assertEqual(r["restores"][2]["status"], "failed", r)
    # rank 0 had queued it, rank 1 failed it: one split, counted on both
    test.assertEqual([r["restores_split"] for r in results], [1, 1])


class TestRankShardNegativeControls(unittest.TestCase):
    def test_without_the_restore_agreement_the_ranks_part_on_the_request(self):
        # Negative control of the decode restore agreement: rank 0 keeps the
        # restore rank 1 failed (ready on one rank, failed on the other).
        results = run_decode_restores(
            {**ON, "SGLANG_HICACHE_RANK_SHARD_EXCHANGE_TIMEOUT_S": "30"}, agree=False
        )
        self.assertEqual(
            [r["restores"][2]["status"] for r in results], ["ready", "failed"]
        )
        with self.assertRaises(AssertionError):
            check_restore_failing_after_its_load(self, results)

    def test_skipping_the_exchange_is_caught(self):
        for model in ("dsa", "mla"):
            results = run_ranks(
                sharded_roundtrip,
                2,
                timeout=900,
                env=ON,
                seed=5,
                steps=20,
                skip_exchange=True,
                model=model,
            )
            self.assertTrue(all(r["sharded"] for r in results), model)
            self.assertTrue(any(r["mismatches"] for r in results), model)

    def test_diverging_host_pages_raise_naming_the_rank(self):
        env = {**ON, "SGLANG_HICACHE_RANK_SHARD_VERIFY_EVERY": "1"}
        with self.assertRaises(RankFailure) as ctx:
            run_ranks(
                sharded_roundtrip,
                2,
                timeout=900,
                env=env,
                seed=5,
                steps=20,
                diverge_rank=1,
            )
        self.assertIn(
            "TP ranks [1] loaded different host pages than rank 0", str(ctx.exception)
        )

    def test_load_back_outside_start_loading_raises(self):
        results = run_ranks(
            sharded_roundtrip,
            2,
            timeout=900,
            env=ON,
            seed=5,
            steps=20,
            direct_submit=True,
        )
        for r in results:
            self.assertIn("must come from HiCacheController.start_loading", r["raised"])


if __name__ == "__main__":
    unittest.main()
