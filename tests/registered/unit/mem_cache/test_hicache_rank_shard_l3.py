"""Rank-sharded HiCache host tier with L3 storage (the ``file`` backend), on CPU.

Real processes (one per TP rank, gloo), DSA and plain MLA stacks built through
upstream's strategies with the patched modules and
``--hicache-storage-backend file``; the controller's own backup thread writes,
its prefetch thread queries and MIN-reduces the hits, ``_page_transfer`` reads.
The stacks have 5 KV layers (rank 0 owns 3, rank 1 owns 2) and, for DSA, 4 live
indexer layers (2 each), so the two shares differ.
"""

import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.hicache_rank_shard_scenarios import l3_shards, require_rank_shard
from harness.stacks.dsa_hicache_stack import dsa_device_pool, publish_server_args

register_cpu_ci(est_time=150, suite="base-a-test-cpu")
FEATURE_GROUP = "hicache-rank-shard"  # the series group it tests (or "series")

ON = {"SGLANG_ENABLE_HICACHE_RANK_SHARD": "1"}
LAYERS, PAGE, PAGES, DELETED = 5, 64, 4, 2
KV_ROW_BYTES = 576 * 2  # bf16 latent + rope row of the test pool
INDEXER_PAGE_BYTES = 132 * 64  # one 64-token indexer page of one layer


def setUpModule():
    require_rank_shard()


def run_l3(model="dsa", variant=None):
    with tempfile.TemporaryDirectory(prefix="hicache-l3-shards-") as storage_dir:
        return run_ranks(
            l3_shards,
            2,
            timeout=600,
            env=ON,
            storage_dir=storage_dir,
            model=model,
            num_pages=PAGES,
            delete_page=DELETED,
            delete_rank=1,
            variant=variant,
        )


def shard_page_bytes(r) -> dict:
    """One page of rank ``r``'s shard objects, from the geometry: its KV
    layers' rows, and its live indexer layers' pages."""
    return dict(
        kv=PAGE * KV_ROW_BYTES * len(r["kv_host_layers"]),
        indexer=INDEXER_PAGE_BYTES * len(r["indexer_host_layers"]),
    )


class L3ShardChecks:
    """Each check raises AssertionError on a broken variant (see the negative
    controls below)."""

    def check_writes(self, results, model):
        t = unittest.TestCase()
        owned = [set(r["kv_host_layers"]) for r in results]
        t.assertEqual(owned, [{0, 2, 4}, {1, 3}])
        files = results[0]["files"]
        t.assertEqual(files, results[1]["files"])  # one directory, one view
        kv_total = 0
        for r in results:
            share = shard_page_bytes(r)
            mine = {n: s for n, s in files.items() if r["key_suffix"] + ".bin" in n}
            kv = {n: s for n, s in mine.items() if ".indexer" not in n}
            ix = {n: s for n, s in mine.items() if ".indexer" in n}
            # one object per page (and one indexer object per page for DSA),
            # each holding exactly this rank's layers
            t.assertEqual(sorted(kv.values()), [share["kv"]] * PAGES, r["rank"])
            t.assertEqual(
                sorted(ix.values()),
                [share["indexer"]] * (PAGES if model == "dsa" else 0),
                r["rank"],
            )
            t.assertEqual(
                r["bytes_written"], PAGES * (share["kv"] + share["indexer"]), r
            )
            kv_total += sum(kv.values())
        # every file belongs to one rank's shard; a page is stored once in all
        t.assertEqual(
            sum(
                len([n for n in files if r["key_suffix"] + ".bin" in n])
                for r in results
            ),
            len(files),
        )
        t.assertEqual(kv_total, PAGES * PAGE * KV_ROW_BYTES * LAYERS)

    def check_reads(self, results):
        t = unittest.TestCase()
        for r in results:
            share = sum(shard_page_bytes(r).values())
            # every shard present: all pages hit, read back bit for bit, each
            # rank reading its own share only
            t.assertEqual(
                r["first"],
                dict(hit=PAGES * PAGE, same=True, bytes_read=PAGES * share),
                r["rank"],
            )
            # rank 1's shard of page DELETED is gone: the page and the ones
            # after it are a miss on both ranks
            t.assertEqual(
                r["second"],
                dict(hit=DELETED * PAGE, same=True, bytes_read=DELETED * share),
                r["rank"],
            )

    def check_identity(self, results):
        t = unittest.TestCase()
        for r in results:
            own = DELETED if r["rank"] == 1 else PAGES
            t.assertEqual(
                r["others"],
                dict(own=own, other_tp=0, other_rule=0, replicated=0),
                r["rank"],
            )


class TestRankShardL3(L3ShardChecks, unittest.TestCase):
    def test_dsa_each_rank_stores_and_reads_its_own_shard(self):
        results = run_l3("dsa")
        self.assertTrue(all(r["sharded"] for r in results))
        self.assertEqual(
            [r["key_suffix"] for r in results],
            ["_rankshard-rr-tp2-r0", "_rankshard-rr-tp2-r1"],
        )
        self.assertEqual([r["indexer_host_layers"] for r in results], [[0, 3], [1, 4]])
        self.check_writes(results, "dsa")
        self.check_reads(results)
        self.check_identity(results)

    def test_mla_each_rank_stores_and_reads_its_own_shard(self):
        results = run_l3("mla")
        self.assertTrue(all(r["sharded"] for r in results))
        self.check_writes(results, "mla")
        self.check_reads(results)
        self.check_identity(results)


class TestRankShardL3Activation(unittest.TestCase):
    """`file` keeps rank shard active; any other backend turns it off with one
    reason line naming the backend and why."""

    @classmethod
    def setUpClass(cls):
        from sglang.srt.runtime_context import reset_context

        cls.addClassCleanup(reset_context)
        publish_server_args(0, 2)
        cls.pool = dsa_device_pool()

    def reasons(self, backend):
        from sglang.srt.mem_cache.hicache_rank_shard.config import (
            rank_shard_inactive_reasons,
        )
        from sglang.srt.runtime_context import get_memory

        with get_memory().override(hicache_storage_backend=backend):
            return rank_shard_inactive_reasons(self.pool)

    def test_file_has_no_reason(self):
        self.assertEqual(self.reasons("file"), [])

    def test_another_backend_is_named_with_why(self):
        # file and mooncake store one shard object per rank (mooncake through
        # the sharded pools' page buffer meta); the others are refused
        for backend in ("file", "mooncake"):
            self.assertEqual(self.reasons(backend), [], backend)
        for backend in ("hf3fs", "nixl", "sim"):
            self.assertEqual(
                self.reasons(backend),
                [
                    f"--hicache-storage-backend {backend} (rank-sharded L3 covers "
                    "only file, mooncake: other backends key an MLA page without "
                    "the rank that holds it or address the host pool as whole "
                    "pages)"
                ],
            )

    def test_l3_on_a_pd_decode_worker_is_accepted(self):
        # A decode restore's L3 wait is agreed across the shard group
        # (the hit query's MIN, the MIN-reduced prefetch progress and ACK
        # drain): test_decode_hicache_rank_shard_l3.py restores through it.
        from sglang.srt.runtime_context import get_disagg

        with get_disagg().override(
            disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True
        ):
            for backend in ("file", "mooncake", None):
                self.assertEqual(self.reasons(backend), [], backend)
            self.assertEqual(len(self.reasons("nixl")), 1)

    def test_a_runtime_attach_answers_as_startup_does(self):
        # /attach_hicache_storage_backend reaches the rank-shard context's
        # check, which gives the startup refusal's reason line; a backend
        # accepted at startup is accepted there too, on a decode worker too.
        from sglang.srt.mem_cache.hicache_rank_shard.plan import RankShardContext
        from sglang.srt.runtime_context import get_disagg

        with get_disagg().override(
            disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True
        ):
            try:
                RankShardContext.check_storage_backend(None, "file")
            except ValueError as e:
                self.fail(f"file attach refused on a decode worker: {e}")
            with self.assertRaises(ValueError) as ctx:
                RankShardContext.check_storage_backend(None, "nixl")
            startup = self.reasons("nixl")
        self.assertEqual(len(startup), 1, startup)
        self.assertIn(startup[0], str(ctx.exception))
        RankShardContext.check_storage_backend(None, "file")  # prefill: accepted


class TestRankShardL3NegativeControls(L3ShardChecks, unittest.TestCase):
    """Each broken variant runs to its end outside ``assertRaises`` (a rank
    that fails, even by an assertion, fails the test); only the check may
    raise the AssertionError it expects."""

    def test_every_rank_writing_rank_0s_key_is_caught(self):
        results = run_l3("dsa", "same_key")
        with self.assertRaises(AssertionError):
            self.check_writes(results, "dsa")

    def test_counting_each_write_twice_is_caught(self):
        results = run_l3("dsa", "double_count")
        with self.assertRaises(AssertionError):
            self.check_writes(results, "dsa")

    def test_hits_without_the_group_min_are_caught(self):
        results = run_l3("dsa", "local_hits")
        with self.assertRaises(AssertionError):
            self.check_reads(results)


if __name__ == "__main__":
    unittest.main()
