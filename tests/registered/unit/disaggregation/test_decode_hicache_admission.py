"""Decode-side HiCache admission (PD disaggregation): read-only prefix match,
batched pre-allocation planning, two-phase L3 prefetch (the host-span lock is
the fixes group's, test_decode_host_span_lock.py).

Runs real ``UnifiedRadixCache`` (HiCache host tier) and decode queue objects on
CPU (``harness.stacks.decode_hicache_stack``; stand-ins only for the KV receiver,
the two ``kvcacheio`` direct ops and pinned registration) in gloo ranks, on both
radix tree cores: each class runs on the Python core and its ``...Rust`` subclass on
the Rust core (0.5.23's default). "Greedy" is the same scenario with the
feature off (``seed_flag=False``), i.e. 0.5.23's admission. Identical scenario runs
are shared between tests.
"""

import copy
import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.result_diff import diff_results
from harness.scenarios.decode_hicache_scenarios import (
    HOST_CHURN,
    admission_sim,
    head_of_queue_admission,
    host_span_restore,
    l3_two_phase,
    peek_vs_match,
    plan_digest,
    planned_then_released,
    require_decode_hicache,
)

register_cpu_ci(est_time=480, suite="base-a-test-cpu")
FEATURE_GROUP = "decode-hicache"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_flag_off_promises_l3_then_fails_when_the_prefetch_stops_short": "flag "
    "off is upstream's two-phase-less prefetch: the L3 span is promised, then "
    "the restore fails, with and without the PR",
}

HOST_SPAN = host_span_restore
SIM = admission_sim
L3 = l3_two_phase
HEAD = head_of_queue_admission
PEEK = peek_vs_match
PRESSURE = dict(size=1024, steps=24, arrivals=(1, 4))

_RUNS: dict = {}


def _run(target, world_size=1, **kwargs):
    """``run_ranks``, memoized on its arguments (scenarios are seeded)."""
    key = (target.__name__, world_size, repr(sorted(kwargs.items())))
    if key not in _RUNS:
        _RUNS[key] = run_ranks(target, world_size, **kwargs)
    return copy.deepcopy(_RUNS[key])


class _OnTreeCore(unittest.TestCase):
    """Runs its scenarios on ``tree_core``; a ``...Rust`` subclass reruns every
    test on the Rust core."""

    tree_core = "python"
    requires_pr = True  # False: a flag-off case, upstream's behaviour

    def setUp(self):
        if self.requires_pr:
            require_decode_hicache()

    def scenario(self, target, world_size=1, **kwargs):
        return _run(target, world_size, tree_core=self.tree_core, **kwargs)


def _strip(results):
    """Drop what differs by construction: the sglang tree and wall times."""
    return [
        {k: v for k, v in r.items() if k != "sglang" and not k.startswith("seconds")}
        for r in results
    ]


class TestPeekPrefix(_OnTreeCore):
    def test_peek_equals_match_and_changes_nothing(self):
        for seed in (0, 1):
            (r,) = self.scenario(PEEK, 1, seed=seed)
            self.assertEqual(r["device_checked"], r["rounds"])
            self.assertEqual(r["unchanged"], r["rounds"])
            self.assertGreater(r["match_changed"], 0)  # the probe sees splits
            # device-only, device + host and host-only prefixes all came up
            self.assertTrue({(True, False), (True, True)} <= set(r["kinds"]), r)
            # No LRU touch: the older prefix is evicted first after a peek,
            # the newer one after match_prefix touched the older (control).
            self.assertEqual(r["lru"]["peek"], (0, 64))
            self.assertEqual(r["lru"]["match"], (64, 0))


class TestAdmissionPlanning(_OnTreeCore):
    def test_planned_admission_leaks_nothing(self):
        (r,) = self.scenario(SIM, 1, seed_flag=True, seed=3, **PRESSURE)
        t = r["totals"]
        self.assertGreater(t["admitted"], 10)
        self.assertGreater(t["evict_calls"], 0)
        self.assertEqual(t["failed_restores"], 0)
        self.assertEqual(len(r["plans"]), 24)
        self.assertEqual(r["host_lock_refs"], 0)
        self.assertEqual(r["protected"], 0)
        after = r["after"]
        self.assertEqual(after["req_slots"], 32)
        self.assertEqual(after["metadata_slots"], 32)
        self.assertEqual(after["device_available"] + after["device_evictable"], 1024)

    def test_no_failed_restore_under_host_churn(self):
        # The host-span lock (fixes group) holds under the planned admission
        # too: the same admissions as the greedy loop, no failed restore.
        for seed in (0, 1):
            greedy = self.scenario(SIM, 1, seed_flag=False, seed=seed, **HOST_CHURN)
            (r,) = self.scenario(SIM, 1, seed_flag=True, seed=seed, **HOST_CHURN)
            self.assertEqual(greedy[0]["totals"]["failed_restores"], 0, seed)
            self.assertEqual(r["totals"]["failed_restores"], 0, seed)
            self.assertEqual(r["totals"]["admitted"], greedy[0]["totals"]["admitted"])
            self.assertEqual(r["host_lock_refs"], 0)

    def test_queue_head_admitted_like_greedy(self):
        # Regression: the commit loop re-judged a planned request against the
        # budget with *all* planned prefixes locked and rejected it every round.
        greedy = self.scenario(HEAD, 1, seed_flag=False)
        (r,) = self.scenario(HEAD, 1, seed_flag=True)
        self.assertEqual(greedy[0]["admitted"][0], ["r1", "r2"])
        self.assertEqual(r["admitted"], greedy[0]["admitted"])
        self.assertEqual(r["queued"], [])
        self.assertEqual(r["host_lock_refs"], 0)

    def test_one_page_aligned_eviction_per_admission_round(self):
        greedy = self.scenario(SIM, 1, seed_flag=False, seed=3, **PRESSURE)
        (r,) = self.scenario(SIM, 1, seed_flag=True, seed=3, **PRESSURE)
        # Same admissions, round by round, as 0.5.23's greedy loop.
        self.assertEqual(
            [s["admitted"] for s in greedy[0]["per_step"]],
            [s["admitted"] for s in r["per_step"]],
        )
        # Greedy evicts per request: some rounds need several calls.
        self.assertGreater(
            max(s["admit_evict_calls"] for s in greedy[0]["per_step"]), 1
        )
        # The plan evicts once per round, a whole number of pages, and the
        # commit loop then finds its pages free (no further eviction; restores
        # may still evict for their load-back later in the step).
        self.assertLessEqual(max(s["admit_evict_calls"] for s in r["per_step"]), 1)
        evicts = [e for _, e, _ in r["plans"]]
        self.assertTrue(any(evicts))
        self.assertTrue(all(e % 16 == 0 for e in evicts), evicts)
        self.assertEqual(
            sum(1 for e in evicts if e),
            sum(s["admit_evict_calls"] for s in r["per_step"]),
        )

    def test_plan_identical_on_every_rank(self):
        for world in (2, 4) if self.tree_core == "python" else (2,):
            results = self.scenario(
                SIM,
                world,
                seed_flag=True,
                seed=5,
                consensus_checker=True,
                env={"SGLANG_ENABLE_RANK_CONSENSUS_CHECKER": "1"},
                **PRESSURE,
            )
            self.assertEqual(len(results), world)
            self.assertGreater(results[0]["totals"]["evict_calls"], 0)
            for r in results[1:]:
                self.assertEqual(diff_results(_strip(results[:1]), _strip([r])), [])

    def test_diverged_rank_is_caught_by_the_consensus_check(self):
        if self.tree_core != "python":
            self.skipTest("checks the consensus checker; runs on the Python core")
        # Negative control: rank 1 reserves more decode tokens per request (its
        # tree and queue are identical), so only its plan differs ...
        digest = plan_digest
        same = self.scenario(digest, 2)
        self.assertEqual(same[0], same[1])
        self.assertGreater(same[0]["entries"], 0)
        r0, r1 = self.scenario(digest, 2, diverge_rank=1)
        self.assertNotEqual(r0["digest"], r1["digest"])
        # ... and with the checker on, the ranks are stopped.
        kw = dict(seed_flag=True, seed=5, diverge_rank=1, **PRESSURE)
        # Stopped by the checker, not by any rank failure: either its report,
        # or its own collective on its dedicated group, which aborts in gloo
        # when the ranks' event counts differ (seen: "20 vs 16 ... collective
        # mismatch"); the same scenario without the checker runs (above).
        stopped = r"Found rank divergence|distributed collective mismatch"
        with self.assertRaisesRegex(RuntimeError, stopped):
            self.scenario(
                SIM,
                2,
                timeout=120,
                consensus_checker=True,
                env={"SGLANG_ENABLE_RANK_CONSENSUS_CHECKER": "1"},
                **kw,
            )


class _OnlyInL3(_OnTreeCore):
    """A prefix only in L3 storage (real file backend)."""

    def _run(self, **kw):
        with tempfile.TemporaryDirectory() as d:
            (r,) = self.scenario(L3, 1, storage_dir=d, **kw)
        self.assertEqual(r["evicted"], (256, 256))
        return r


class TestL3PrefetchFlagOff(_OnlyInL3):
    requires_pr = False

    def test_flag_off_promises_l3_then_fails_when_the_prefetch_stops_short(self):
        # best_effort stops the prefetch at the first check: 0.5.23 has
        # already promised the L3 span to prefill, so the restore FAILs.
        r = self._run(seed_flag=False, policy="best_effort")
        self.assertEqual((r["admitted_at"], r["l3"], r["promised"]), (0, 256, 256))
        self.assertEqual(r["status"], "failed")


class TestTwoPhaseL3Prefetch(_OnlyInL3):
    def test_two_phase_waits_for_host_then_promises_only_what_landed(self):
        r = self._run(seed_flag=True, policy="wait_complete")
        self.assertGreaterEqual(r["admitted_at"], 1)  # held while prefetching
        self.assertEqual((r["l2"], r["l3"], r["promised"]), (256, 0, 256))
        self.assertEqual(r["status"], "ready")
        self.assertIs(r["restored_bytes_equal"], True)
        # promised from host, but it came from L3: counted as storage hits
        self.assertEqual(r["storage_hit_length"], 256)
        self.assertEqual(r["host_lock_refs"], 0)

    def test_two_phase_never_promises_what_did_not_land(self):
        r = self._run(seed_flag=True, policy="best_effort")
        self.assertEqual(r["l3"], 0)
        self.assertEqual(r["promised"], r["l1"] + r["l2"])
        self.assertEqual(r["status"], "ready")
        # rows that reached host memory are restored byte for byte; none: no restore
        self.assertEqual(r["restored_bytes_equal"], True if r["l2"] else None)

    def test_two_phase_under_the_timeout_policy_promises_only_host_rows(self):
        # timeout: the prefetch settles when it completes or its deadline
        # passes; either way only what reached host memory is promised.
        r = self._run(seed_flag=True, policy="timeout")
        self.assertGreaterEqual(r["admitted_at"], 1)  # held while prefetching
        self.assertEqual(r["l3"], 0)
        self.assertEqual(r["promised"], r["l1"] + r["l2"])
        self.assertEqual(r["status"], "ready")
        # rows that reached host memory are restored byte for byte; none: no restore
        self.assertEqual(r["restored_bytes_equal"], True if r["l2"] else None)
        self.assertEqual(r["host_lock_refs"], 0)

    def test_two_phase_agrees_on_two_ranks(self):
        # Two TP ranks (gloo) share the L3 directory: both hold the request
        # for the same rounds, then promise and restore the same host rows.
        with tempfile.TemporaryDirectory() as d:
            results = self.scenario(
                L3,
                2,
                storage_dir=d,
                seed_flag=True,
                policy="wait_complete",
                env={"SGLANG_ENABLE_RANK_CONSENSUS_CHECKER": "1"},
            )
        keys = ("admitted_at", "l1", "l2", "l3", "promised", "status")
        first = {k: results[0][k] for k in keys}
        self.assertGreaterEqual(first["admitted_at"], 1)
        self.assertEqual(
            (first["l3"], first["promised"]), (0, first["l1"] + first["l2"])
        )
        self.assertEqual(first["status"], "ready")
        for r in results:
            self.assertEqual({k: r[k] for k in keys}, first)
            self.assertIs(r["restored_bytes_equal"], True)
            self.assertEqual(r["host_lock_refs"], 0)


class TestAbortCleanup(_OnTreeCore):
    def test_abort_while_prefetching_releases_everything(self):
        with tempfile.TemporaryDirectory() as d:
            (r,) = self.scenario(
                L3,
                1,
                storage_dir=d,
                seed_flag=True,
                abort_while_prefetching=True,
            )
        self.assertTrue(r["pending_before_abort"])
        self.assertIsNone(r["admitted_at"])
        self.assertEqual(r["ongoing_prefetch"], 0)
        self.assertEqual(r["after"], r["start"])
        self.assertEqual(r["host_lock_refs"], 0)

    def test_abort_while_restoring_releases_everything(self):
        (r,) = self.scenario(HOST_SPAN, 1, seed_flag=True, abort_restoring=True)
        self.assertEqual(r["status"], "pending")
        self.assertTrue(r["host_locked"])
        self.assertEqual(r["host_lock_refs"], 0)
        self.assertEqual(r["after"]["device_protected"], 0)
        self.assertEqual(r["after"]["req_slots"], 16)
        self.assertEqual(r["after"]["metadata_slots"], 16)
        self.assertEqual(
            r["after"]["device_available"] + r["after"]["device_evictable"], 1024
        )
        self.assertEqual(r["after"]["host_available"], r["start"]["host_available"])

    def test_planned_but_not_committed_releases_everything(self):
        (r,) = self.scenario(planned_then_released, 1)
        p = r["planned"]
        self.assertEqual(p["entries"], 3)
        self.assertEqual(p["host_spans"], 1)
        self.assertGreater(p["protected"], 0)
        self.assertEqual(p["host_lock_refs"], 1)
        rel = r["released"]
        self.assertEqual((rel["protected"], rel["host_lock_refs"]), (0, 0))
        # Nothing but the batch eviction moved: evictable pages became free.
        for k in ("host_available", "req_slots", "metadata_slots"):
            self.assertEqual(rel["snapshot"][k], r["start"][k])
        self.assertEqual(
            rel["snapshot"]["device_available"] + rel["snapshot"]["device_evictable"],
            r["start"]["device_available"] + r["start"]["device_evictable"],
        )
        self.assertEqual(r["admitted"], ["r0", "r1", "r2"])

    def test_abort_while_queued_releases_everything(self):
        (r,) = self.scenario(HOST_SPAN, 1, seed_flag=True, abort_queued=True)
        self.assertEqual(r["admitted"], [])
        self.assertEqual(r["after"], r["start"])
        self.assertEqual(r["host_lock_refs"], 0)


class TestTreeCoresAgree(unittest.TestCase):
    def setUp(self):
        require_decode_hicache()

    def test_planned_admission_identical_on_both_cores(self):
        # Same workload, same plans (digests), admissions and evictions on the
        # Python core and the Rust core.
        py, rust = (
            _run(SIM, 1, seed_flag=True, seed=3, tree_core=c, **PRESSURE)
            for c in ("python", "rust")
        )
        self.assertGreater(len(py[0]["plans"]), 0)
        self.assertEqual(diff_results(_strip(py), _strip(rust)), [])


class TestPeekPrefixRust(TestPeekPrefix):
    tree_core = "rust"


class TestAdmissionPlanningRust(TestAdmissionPlanning):
    tree_core = "rust"


class TestL3PrefetchFlagOffRust(TestL3PrefetchFlagOff):
    tree_core = "rust"


class TestTwoPhaseL3PrefetchRust(TestTwoPhaseL3Prefetch):
    tree_core = "rust"


class TestAbortCleanupRust(TestAbortCleanup):
    tree_core = "rust"


if __name__ == "__main__":
    unittest.main()
