"""A rank-sharded PD decode worker with L3 storage: the two-phase prefetch of
decode HiCache (and 0.5.23's one-phase decode prefetch) over a rank-sharded
host tier, at TP=2 (real processes, gloo, real ``file`` backend).

A prefix lives only in L3 (written through from both ranks' sharded host
pools: one object per rank and page, each holding that rank's owned layer),
then one request for it is admitted and restored through the real
``DecodePreallocQueue`` / ``DecodeTransferQueue`` over a real
``UnifiedRadixCache`` (``harness.stacks.decode_hicache_stack``). Upstream's
rank-consensus checker (``SGLANG_ENABLE_RANK_CONSENSUS_CHECKER``) runs on
every rank. Claims:

* the shard group holds the request for the same rounds although one rank's
  L3 reads are slower, then promises and restores the same span, byte for
  byte, with identical radix trees;
* each rank reads only its own shard: prefix tokens x one layer's row;
* one rank's object of a page deleted: every rank promises only the pages
  before it (never a page one rank lacks).
"""

import copy
import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.decode_hicache_scenarios import (
    l3_two_phase,
    require_decode_hicache,
)
from harness.scenarios.hicache_rank_shard_scenarios import require_rank_shard

register_cpu_ci(est_time=120, suite="base-a-test-cpu")
FEATURE_GROUP = "series"  # the series group it tests (or "series")

ENV = {
    "SGLANG_ENABLE_HICACHE_RANK_SHARD": "1",
    "SGLANG_ENABLE_RANK_CONSENSUS_CHECKER": "1",
}
PAGE = 16
# The decode stack's MLA pool: 2 layers of a 64 + 16 bf16 latent row; each
# of the two ranks owns one layer.
ROW_BYTES_PER_LAYER = (64 + 16) * 2
LAYERS_PER_RANK = 1
_RUNS: dict = {}


def run(**kwargs):
    """Both ranks' results of ``l3_two_phase`` (memoized: seeded scenarios)."""
    key = repr(sorted(kwargs.items()))
    if key not in _RUNS:
        with tempfile.TemporaryDirectory(prefix="decode-l3-shards-") as d:
            _RUNS[key] = run_ranks(
                l3_two_phase,
                2,
                timeout=600,
                env=ENV,
                storage_dir=d,
                policy="wait_complete",
                **kwargs,
            )
    return copy.deepcopy(_RUNS[key])


class Checks:
    """Each check raises AssertionError on a broken variant (see the negative
    control below)."""

    def check_agreed(self, results, promised: int) -> None:
        keys = ("admitted_at", "l1", "l2", "l3", "promised", "status")
        first = {k: results[0][k] for k in keys}
        for r in results:
            self.assertTrue(r["sharded"], "rank shard did not activate")
            # all of it came from L3: counted as storage hits
            self.assertEqual(r["storage_hit_length"], promised)
            self.assertEqual({k: r[k] for k in keys}, first, f"rank {r}")
            self.assertEqual(r["tree"], results[0]["tree"], "the radix trees differ")
            self.assertEqual(r["host_lock_refs"], 0)
        self.assertEqual((first["promised"], first["status"]), (promised, "ready"))

    def check_own_shard_restored(self, results, tokens: int) -> None:
        self.assertEqual(
            sorted(tuple(r["kv_host_layers"]) for r in results), [(0,), (1,)]
        )
        for r in results:
            self.assertIs(r["restored_bytes_equal"], True, "restored rows differ")
            self.assertEqual(
                r["l3_bytes_read"], tokens * ROW_BYTES_PER_LAYER * LAYERS_PER_RANK
            )


class TestRankShardedDecodeL3(Checks, unittest.TestCase):
    def setUp(self):
        require_rank_shard()

    def test_two_phase_prefetch_is_held_and_restored_alike_with_a_slow_rank(self):
        require_decode_hicache()
        results = run(seed_flag=True, slow_rank=1)
        self.check_agreed(results, promised=256)
        # held while prefetching: rank 1's 16 page reads take >= 0.3 s each
        self.assertGreaterEqual(results[0]["admitted_at"], 1)
        self.assertEqual(results[0]["l2"], 256)
        self.check_own_shard_restored(results, 256)

    def test_a_page_missing_on_one_rank_is_promised_by_no_rank(self):
        require_decode_hicache()
        # 32 pages; rank 1's object of page 24 deleted: pages 0..23 are a
        # hit on both ranks (the group's MIN), page 24 on none.
        results = run(seed_flag=True, drop_shard=(1, 24), prefix_tokens=512)
        for r in results:
            self.assertEqual(len(r["dropped"]), 1, r["dropped"])
        self.check_agreed(results, promised=24 * PAGE)
        self.check_own_shard_restored(results, 24 * PAGE)

    def test_upstream_one_phase_decode_prefetch_is_restored_alike(self):
        # 0.5.23's decode path (no seed flag): the L3 span is promised at
        # admission and the restore waits for the prefetch on every rank.
        results = run(seed_flag=False, slow_rank=0)
        self.check_agreed(results, promised=256)
        self.assertEqual(results[0]["l3"], 256)
        self.check_own_shard_restored(results, 256)


class TestRankShardedDecodeL3NegativeControl(Checks, unittest.TestCase):
    """The broken variant runs to its end outside ``assertRaises``; only the
    check may raise the AssertionError it expects."""

    def test_every_rank_reading_rank_0s_objects_is_caught(self):
        require_rank_shard()
        require_decode_hicache()
        results = run(seed_flag=True, variant="same_key")
        with self.assertRaisesRegex(AssertionError, "restored rows differ"):
            self.check_own_shard_restored(results, 256)


if __name__ == "__main__":
    unittest.main()
