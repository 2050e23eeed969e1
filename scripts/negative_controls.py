#!/usr/bin/env python3
"""Negative controls: break the installed wheel on purpose; its tests must fail.

    python scripts/negative_controls.py [--set cheap|all] [--control NAME ...]
    make negative-controls [CONTROLS=cheap] [CONTROL=name]

Each control models one bug: an exact text replacement (``old`` -> ``new``) in
one module of the installed sglang package. For each control this script

1. copies the installed package (the test venv's ``site-packages/sglang``) to
   ``build/negative-controls/<control>/sglang`` with hard links, then replaces
   the one module by a new file (unlinked first: the venv's file, a hard link
   of the same inode, is untouched) holding the mutation, and drops its
   cached bytecode. A control whose ``old`` text does not occur exactly once
   is refused as stale, so no control rots silently;
2. runs the control's tests with that copy first on ``PYTHONPATH`` (the test
   process, its rank processes and the live servers it starts all inherit it);
3. requires them to fail *on their assertions*: at least one failure of each
   expected kind is an ``AssertionError`` whose message or test id contains
   the expected text, and none of its tests has a collection error or another
   exception (``negative_control_plugin`` classifies each failure).

It prints ``control | test | expected failure | seen``, writes
``build/negative-controls/summary.json`` and exits 1 unless every control
failed on its assertion. Proof that the mutated copy ran: the mutated module
records each process that imports it (appended lines that only write to
``$NEGATIVE_CONTROL_IMPORTS``), and the test process's ``sglang.__file__``.

``cheap`` controls run unit tests (CI runs them, tests/tooling/
test_negative_controls.py), one per core at once (each in its own scratch
copy, all forked from one warm interpreter; ``--jobs``); ``full`` ones start
live servers and run one at a time.
``--controls-json FILE`` replaces the built-in controls (the driver's own
tests use it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common import BUILD, ROOT, ToolError, run_main
from warm_python import THIRD_PARTY, WarmPython

OUT = BUILD / "negative-controls"
PLUGIN = "negative_control_plugin"
LEVELS = ("cheap", "full")
TIMEOUT_S = {"cheap": 900, "full": 1800}

R = "tests/registered/"
# The Mooncake backend's zero-copy get (three controls mutate it), and the
# mutation under which a rank-sharded server's gets report success and read
# nothing (two of them: the DSA restart and the PD decode worker).
MOONCAKE_GET = (
    "            results = self.store.batch_get_into(key_strs, buffer_ptrs, "
    "buffer_sizes)\n"
)
MOONCAKE_GET_READS_NOTHING = (
    "            results = (  # negative control: a shard get reads nothing\n"
    "                list(buffer_sizes) if self.rank_shard is not None\n"
    "                else self.store.batch_get_into(key_strs, buffer_ptrs, "
    "buffer_sizes)\n"
    "            )\n"
)
DISPATCH = R + "unit/managers/test_cache_aware_dispatch.py"
RANK_SHARD_MLA2 = (
    R + "unit/mem_cache/test_hicache_rank_shard.py::TestRankShardMlaTwoRanks"
)
RANK_SHARD_L3 = R + "unit/mem_cache/test_hicache_rank_shard_l3.py::TestRankShardL3"
RANK_SHARD_SERVER_DSA = (
    R + "server/test_hicache_rank_shard_server.py::TestRankShardServerDSA"
)


@dataclass(frozen=True)
class Control:
    name: str
    level: str  # cheap | full
    module: str  # path of the module inside the sglang package
    old: str  # exact text, must occur once
    new: str
    tests: tuple  # pytest node ids, relative to the repository root
    # Substrings: each must be in the message or test id of a failure that
    # is an AssertionError.
    expected: tuple
    what: str  # the bug the mutation models

    @classmethod
    def from_dict(cls, d: dict) -> "Control":
        d = dict(d)
        d["tests"] = tuple(d["tests"])
        d["expected"] = tuple(d["expected"])
        return cls(**d)


CONTROLS = (
    Control(
        name="router-ignores-landings",
        level="cheap",
        module="srt/managers/dp_routing/router.py",
        old="            self.pending.add(rank, keys, now)\n",
        new="            pass  # negative control: the landing is ignored\n",
        tests=(DISPATCH + "::TestPrefillLandings",),
        expected=(
            "test_partial_landing_credits_its_whole_chunks_on_its_rank_only",
            "test_follower_after_the_landing_reuses_it",
        ),
        what="a landed prefill never becomes a pending prefix on its rank",
    ),
    Control(
        name="client-routed-request-not-recorded",
        level="cheap",
        module="srt/managers/data_parallel_controller.py",
        old="            self.cache_aware_router.record_external(\n",
        new="            (lambda *_: None)(  # negative control: not recorded\n",
        tests=(DISPATCH + "::TestPrefillLandings",),
        expected=("test_a_client_routed_request_is_its_own_outcome_and_lands",),
        what="a request that names its DP rank is sent there but the router "
        "records nothing of it (no outcome, load or prefix credit)",
    ),
    Control(
        name="landing-credits-unknown-rid",
        level="cheap",
        module="srt/managers/dp_routing/in_flight.py",
        old="        entry = self.entries.get(rid)\n",
        new=(
            "        if rid not in self.entries:  # negative control: any on the rank\n"
            "            rid = next(\n"
            "                (r for r, e in self.entries.items() if e.rank == rank), rid\n"
            "            )\n"
            "        entry = self.entries.get(rid)\n"
        ),
        tests=(DISPATCH + "::TestPrefillLandings",),
        expected=("test_landing_of_an_unknown_rid_credits_nothing",),
        what="a landing of a rid never dispatched credits the rank's request in flight",
    ),
    Control(
        name="no-stalls-reported",
        level="cheap",
        module="srt/managers/dp_routing/router.py",
        old=(
            "        return self.stalls.update(budget, active, "
            "self.digests.latest, self.clock())\n"
        ),
        new=(
            "        self.stalls.update(budget, active, "
            "self.digests.latest, self.clock())\n"
            "        return set()  # negative control: no stalled rank reported\n"
        ),
        tests=(DISPATCH + "::TestStalledRanks",),
        expected=(
            "test_stalled_rank_is_routed_around",
            "test_one_warning_per_stall_and_counters",
        ),
        what="the stall watch sees the quiet rank, the router is told of none",
    ),
    Control(
        name="router-ignores-host-digests",
        level="cheap",
        module="srt/managers/dp_routing/rank_digests.py",
        old="        return index.update(rank, d.gpu, d.host)\n",
        new="        return index.update(rank, d.gpu, frozenset())  # negative control\n",
        tests=(DISPATCH + "::TestCacheAwareDispatch::test_host_hits_weigh_less",),
        expected=("host_beats_short_gpu",),
        what="the router indexes no host-tier (L2) chunk of any digest",
    ),
    Control(
        name="digest-leaves-out-host-tier",
        level="cheap",
        module="srt/managers/dp_routing/tracker.py",
        old="_HOST_MEDIA = frozenset({StorageMedium.CPU.value})\n",
        new="_HOST_MEDIA = frozenset()  # negative control: host blocks untracked\n",
        tests=(
            R + "unit/managers/test_prefix_digest.py::TestDigestTracker"
            "::test_host_tier_and_reset",
        ),
        expected=("test_host_tier_and_reset",),
        what="a rank's digest leaves out its host-tier (L2) blocks",
    ),
    Control(
        name="staging-view-64-bytes-long",
        level="cheap",
        module="srt/mem_cache/hicache_rank_shard/exchange.py",
        old=(
            "    if pieces:\n" "        chunks.append((staging[:off], tuple(pieces)))\n"
        ),
        new=(
            "    if pieces:  # negative control: 64 bytes past the rows\n"
            "        chunks.append((staging[: off + 64], tuple(pieces)))\n"
        ),
        tests=(
            RANK_SHARD_MLA2
            + "::test_host_copies_touch_only_owned_layers_with_owned_bytes",
        ),
        expected=("test_host_copies_touch_only_owned_layers_with_owned_bytes",),
        what="each broadcast sends its staging view 64 bytes longer than its rows",
    ),
    Control(
        name="l3-refusal-decorator-removed",
        level="cheap",
        module="srt/mem_cache/hicache_rank_shard/host_pools.py",
        old="@_refuse_l3_page_access\nclass RankShardedMLATokenToKVPoolHost(",
        new="class RankShardedMLATokenToKVPoolHost(",
        tests=(
            RANK_SHARD_MLA2
            + "::test_sharded_pools_address_their_own_pages_for_zero_copy_l3",
        ),
        expected=("test_sharded_pools_address_their_own_pages_for_zero_copy_l3",),
        what="the sharded MLA KV host pool registers as whole-layer slabs",
    ),
    Control(
        name="l3-page-meta-wrong-stride",
        level="cheap",
        module="srt/mem_cache/pool_host/mla.py",
        old="                    + index * self.layer_num * self.kv_cache_dim * "
        "self.dtype.itemsize\n",
        new="                    + index * (self.layer_num + 1) * self.kv_cache_dim * "
        "self.dtype.itemsize  # negative control\n",
        tests=(
            RANK_SHARD_MLA2
            + "::test_sharded_pools_address_their_own_pages_for_zero_copy_l3",
        ),
        expected=("meta addresses another page",),
        what="the MLA host pool's zero-copy page meta strides by one layer more "
        "than the pool holds",
    ),
    Control(
        name="l3-shard-key-without-rank",
        level="full",  # test_hicache_rank_shard_l3.py runs it in-test too
        module="srt/mem_cache/hicache_rank_shard/storage.py",
        old='    return f"_rankshard-{rule}-tp{tp_size}-r{rank}"\n',
        new='    return f"_rankshard-{rule}-tp{tp_size}-r0"  # negative control\n',
        tests=(RANK_SHARD_L3 + "::test_dsa_each_rank_stores_and_reads_its_own_shard",),
        expected=("test_dsa_each_rank_stores_and_reads_its_own_shard",),
        what="every rank stores its L3 shard under rank 0's key",
    ),
    Control(
        name="l3-written-bytes-counted-twice",
        level="full",  # test_hicache_rank_shard_l3.py runs it in-test too
        module="srt/mem_cache/hicache_rank_shard/storage.py",
        old='        self._count("written", nbytes)\n',
        new='        self._count("written", 2 * nbytes)  # negative control\n',
        tests=(RANK_SHARD_L3 + "::test_mla_each_rank_stores_and_reads_its_own_shard",),
        expected=("test_mla_each_rank_stores_and_reads_its_own_shard",),
        what="each L3 object written is counted twice",
    ),
    Control(
        name="l3-shard-key-without-rank-live",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/storage.py",
        old='    return f"_rankshard-{rule}-tp{tp_size}-r{rank}"\n',
        new='    return f"_rankshard-{rule}-tp{tp_size}-r0"  # negative control\n',
        tests=(
            RANK_SHARD_SERVER_DSA + "::test_l3_every_rank_stores_its_own_share_once",
        ),
        expected=("test_l3_every_rank_stores_its_own_share_once",),
        what="every rank of a live server stores its L3 shard under rank 0's key",
    ),
    Control(
        name="l3-shard-key-per-instance-live",
        level="full",
        module="srt/mem_cache/storage/mooncake_store/mooncake_store.py",
        old='                self.config_prefix = "_".join(config_prefix_parts)\n',
        new='                self.config_prefix = "_".join(config_prefix_parts) + str('
        "os.getpid())  # negative control\n",
        tests=(RANK_SHARD_SERVER_DSA + "::test_two_sharded_instances_share_one_store",),
        expected=("test_two_sharded_instances_share_one_store",),
        what="each live Mooncake L3 instance keys its objects for itself alone",
    ),
    Control(
        name="l3-read-bytes-counted-twice-live",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/storage.py",
        old='        self._count("read", nbytes)\n',
        new='        self._count("read", 2 * nbytes)  # negative control\n',
        tests=(
            RANK_SHARD_SERVER_DSA + "::test_l3_restart_serves_revisits_from_storage",
        ),
        expected=("test_l3_restart_serves_revisits_from_storage",),
        what="each L3 object a live server reads is counted twice",
    ),
    Control(
        name="l3-mooncake-key-without-shard-live",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/storage.py",
        old='        return f"{base}{self.key_suffix}" if base else self.key_suffix[1:]\n',
        new="        return base  # negative control\n",
        tests=(
            RANK_SHARD_SERVER_DSA + "::test_l3_every_rank_stores_its_own_share_once",
        ),
        expected=("test_l3_every_rank_stores_its_own_share_once",),
        what="a live rank-sharded server keys its Mooncake objects as upstream's "
        "unsharded pages",
    ),
    Control(
        name="l3-shard-read-skipped-live",
        level="full",
        module="srt/mem_cache/storage/mooncake_store/mooncake_store.py",
        old=MOONCAKE_GET,
        new=MOONCAKE_GET_READS_NOTHING,
        tests=(
            RANK_SHARD_SERVER_DSA + "::test_l3_restart_serves_revisits_from_storage",
        ),
        expected=("Lists differ",),
        what="a rank-sharded server's Mooncake gets report success and read "
        "nothing into its host tier",
    ),
    Control(
        name="decode-l3-shard-read-of-rank-0-live",
        level="full",
        module="srt/mem_cache/storage/mooncake_store/mooncake_store.py",
        old=MOONCAKE_GET,
        new="            results = self.store.batch_get_into(  # negative control\n"
        '                [k.replace("-r1_", "-r0_") for k in key_strs], buffer_ptrs, '
        "buffer_sizes\n            )\n",
        tests=(
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_a_rank_sharded_decode_worker_restores_its_shards_from_l3",
        ),
        expected=("Lists differ",),
        what="a rank-sharded PD decode worker's rank 1 restores rank 0's L3 shard",
    ),
    Control(
        name="decode-l3-shard-read-skipped-live",
        level="full",
        module="srt/mem_cache/storage/mooncake_store/mooncake_store.py",
        old=MOONCAKE_GET,
        new=MOONCAKE_GET_READS_NOTHING,
        tests=(
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_a_rank_sharded_decode_worker_restores_its_shards_from_l3",
        ),
        expected=("Lists differ",),
        what="a rank-sharded PD decode worker's Mooncake gets report success and "
        "read nothing (the slots hold the fillers' KV)",
    ),
    Control(
        name="rank-shard-load-back-not-agreed",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/agreement.py",
        old="        if all(v == GO for v in verdicts):\n",
        new="        if verdict == GO:  # negative control: each rank decides alone\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py"
            "::TestRankShardLoadBackAgreement::test_each_divergence_point_is_decided_by_the_group",
        ),
        expected=("the ranks did not take the load-backs together",),
        what="a rank-sharded load-back is decided by each rank alone",
    ),
    Control(
        name="rank-shard-eviction-not-agreed",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/agreement.py",
        old="            return True, max(row[1] for row in rows)\n",
        new="            return True, rows[self.rank][1]  # negative control: own eviction\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py"
            "::TestRankShardLoadBackAgreement::test_each_divergence_point_is_decided_by_the_group",
        ),
        expected=("the ranks' radix trees differ",),
        what="each rank of a shard group evicts for a load-back what it needs alone",
    ),
    Control(
        name="rank-shard-tree-digest-unchecked",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/agreement.py",
        old="        if len(set(digests)) > 1:\n",
        new="        if False:  # negative control: tree digests not compared\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py"
            "::TestRankShardLoadBackAgreement"
            "::test_verified_ranks_whose_trees_parted_stop_at_the_next_vote",
        ),
        expected=("test_verified_ranks_whose_trees_parted_stop_at_the_next_vote",),
        what="ranks whose radix trees parted go on loading under VERIFY_EVERY",
    ),
    Control(
        name="rank-shard-rust-tree-not-verified",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/load_back.py",
        old="        return _interface_digest(cache)\n",
        new="        return 0  # negative control: the Rust core's tree unread\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py"
            "::TestRankShardLoadBackAgreement"
            "::test_the_rust_tree_core_is_verified_too",
        ),
        expected=("test_the_rust_tree_core_is_verified_too",),
        what="the Rust tree core's ranks are not compared under VERIFY_EVERY",
    ),
    Control(
        name="rank-shard-allocation-not-agreed",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/agreement.py",
        old="        return not failed\n",
        new="        return allocated  # negative control: each rank keeps its own\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py"
            "::TestRankShardLoadBackAgreement::test_each_divergence_point_is_decided_by_the_group",
        ),
        expected=("the ranks did not take the load-backs together",),
        what="a rank whose allocation failed after the vote stays out of the exchange",
    ),
    Control(
        name="rank-shard-votes-untagged",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/agreement.py",
        old="                if len(set(header)) > 1:\n",
        new="                if False:  # negative control: votes not checked\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py"
            "::TestRankShardLoadBackAgreement"
            "::test_a_vote_on_another_path_fails_on_every_rank_naming_both_votes",
        ),
        expected=("test_a_vote_on_another_path_fails_on_every_rank_naming_both_votes",),
        what="a load-back vote pairs with a peer's decode restore vote",
    ),
    Control(
        name="rank-shard-failed-restore-load-not-drained",
        level="full",
        module="srt/disaggregation/decode_hicache_mixin.py",
        old="            if cc.rank_shard is not None and cc.load_queue:\n",
        new="            if False:  # negative control: left for the next restore\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py"
            "::TestRankShardDecodeRestores"
            "::test_a_restore_failing_on_one_rank_after_its_load_fails_on_both",
        ),
        expected=("test_a_restore_failing_on_one_rank_after_its_load_fails_on_both",),
        what="a load queued for a restore the group failed waits for another restore",
    ),
    Control(
        name="rank-shard-decode-l3-refused",
        level="cheap",
        module="srt/mem_cache/hicache_rank_shard/config.py",
        old="    need(storage_refusal is None, storage_refusal)\n",
        new="    need(storage_refusal is None and get_disagg().disaggregation_mode "
        '!= "decode", storage_refusal or "decode L3")  # negative control\n',
        tests=(RANK_SHARD_L3 + "Activation",),
        expected=("test_l3_on_a_pd_decode_worker_is_accepted",),
        what="L3 refused again on a rank-sharded PD decode worker",
    ),
    Control(
        name="rank-shard-decode-l3-attach-refused",
        level="cheap",
        module="srt/mem_cache/hicache_rank_shard/plan.py",
        old="        reason = storage_backend_refusal(backend)\n",
        new="        from sglang.srt.runtime_context import get_disagg  # negative control\n"
        "        reason = storage_backend_refusal(backend) or (\n"
        '            "decode L3" if get_disagg().disaggregation_mode == "decode" '
        "else None\n        )\n",
        tests=(RANK_SHARD_L3 + "Activation",),
        expected=("test_a_runtime_attach_answers_as_startup_does",),
        what="L3 refused again at a runtime attach on a rank-sharded PD decode worker",
    ),
    Control(
        name="decode-l3-shard-keys-shared",
        level="full",
        module="srt/mem_cache/hicache_rank_shard/storage.py",
        old="        self.key_suffix = shard_key_suffix(tp_size, rank, rule)\n",
        new="        self.key_suffix = shard_key_suffix(tp_size, 0, rule)  "
        "# negative control\n",
        tests=(
            R + "unit/disaggregation/test_decode_hicache_rank_shard_l3.py"
            "::TestRankShardedDecodeL3"
            "::test_two_phase_prefetch_is_held_and_restored_alike_with_a_slow_rank",
        ),
        expected=(
            "test_two_phase_prefetch_is_held_and_restored_alike_with_a_slow_rank",
        ),
        what="every rank of a decode shard group stores and reads rank 0's objects",
    ),
    Control(
        name="rank-shard-decode-worker-refused",
        level="cheap",
        module="srt/mem_cache/hicache_rank_shard/config.py",
        old='        or get_disagg().disaggregation_decode_retraction_backup != "host_pool",\n',
        new="        or False,  # negative control: every PD decode worker refused\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py::TestRankShardDecodeWorker",
            R + "unit/mem_cache/test_hicache_rank_shard.py::TestRankShardDecodeRestores"
            "::test_the_decode_host_tier_holds_only_owned_layers",
        ),
        expected=(
            "test_a_pd_decode_worker_qualifies",
            "test_the_decode_host_tier_holds_only_owned_layers",
        ),
        what="rank shard stays refused on every PD decode worker",
    ),
    Control(
        name="rank-shard-host-pool-retraction-allowed",
        level="cheap",
        module="srt/mem_cache/hicache_rank_shard/config.py",
        old='        or get_disagg().disaggregation_decode_retraction_backup != "host_pool",\n',
        new="        or True,  # negative control: host-pool retraction allowed\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py::TestRankShardDecodeWorker",
        ),
        expected=("test_host_pool_retraction_is_refused_naming_the_flag",),
        what="a decode worker retracting to the host pool is rank-sharded",
    ),
    Control(
        name="rank-shard-decode-restore-not-agreed",
        level="full",
        module="srt/managers/cache_controller.py",
        old="        return self.rank_shard.agreement.agree_each(oks)\n",
        new="        return oks  # negative control: each rank keeps its own outcome\n",
        tests=(
            R + "unit/mem_cache/test_hicache_rank_shard.py"
            "::TestRankShardDecodeRestores",
        ),
        expected=("test_a_restore_failing_on_one_rank_after_its_load_fails_on_both",),
        what="a PD decode restore that failed on one rank stays queued on the others",
    ),
    Control(
        name="prompt-id-check-removed",
        level="cheap",
        module="srt/managers/tokenizer_manager.py",
        old="        self._validate_prompt_token_ids(obj, input_ids)\n",
        new="",
        tests=(
            R + "unit/managers/test_request_validation.py::TestRequestValidation"
            "::test_prompt_ids_outside_the_vocabulary",
        ),
        expected=("ValueError not raised",),
        what="fixes/0001 without its prompt token id check",
    ),
    Control(
        name="configure-logging-applied-before-check",
        level="cheap",
        module="srt/utils/request_logger.py",
        old="        check_request_log_settings(log_requests_level, log_requests_format)\n"
        "        if log_requests is not None:\n"
        "            self.log_requests = log_requests\n",
        new="        if log_requests is not None:\n"
        "            self.log_requests = log_requests\n"
        "        check_request_log_settings(log_requests_level, log_requests_format)\n",
        tests=(
            R + "unit/managers/test_configure_logging_validation.py"
            "::TestConfigureLoggingValidation"
            "::test_level_out_of_range_is_refused_and_changes_nothing",
        ),
        expected=("a refused request changed state",),
        what="fixes/0014 refusing the level after applying log_requests (half state)",
    ),
    Control(
        name="auto-never-selects-cache-aware",
        level="cheap",
        module="srt/arg_groups/cache_aware_routing_hook.py",
        old='    return (\n        cfg.disaggregation_mode == "decode"\n',
        new="    return False and (  # negative control\n"
        '        cfg.disaggregation_mode == "decode"\n',
        tests=(
            R + "unit/server_args/test_feature_off_matches_upstream.py"
            "::TestFeatureOffMatchesUpstream::test_only_the_readme_exception_differs",
            R + "unit/server_args/test_feature_off_matches_upstream.py"
            "::TestFeatureOffMatchesUpstream"
            "::test_decode_hicache_switch_auto_selects_cache_aware",
        ),
        expected=(
            "test_only_the_readme_exception_differs",
            "test_decode_hicache_switch_auto_selects_cache_aware",
        ),
        what="auto resolves round_robin on a multi-DP PD decode worker with "
        "the decode radix cache (the README's one flag-off exception gone)",
    ),
    Control(
        name="planner-skips-batch-eviction",
        level="cheap",
        module="srt/disaggregation/decode_hicache_planner.py",
        old="        plan.evict_tokens = self._batch_deficit(plan)\n",
        new="        plan.evict_tokens = 0  # negative control: no batch eviction\n",
        tests=(
            R + "unit/disaggregation/test_decode_hicache_admission.py"
            "::TestAdmissionPlanning::test_one_page_aligned_eviction_per_admission_round",
        ),
        expected=("test_one_page_aligned_eviction_per_admission_round",),
        what="the decode admission plan never evicts once for its batch",
    ),
    Control(
        name="planner-skips-lock",
        level="cheap",
        module="srt/disaggregation/decode_hicache_planner.py",
        old="                prefix_len = prefix_match.l1_prefix_len\n",
        new="                prefix_len = prefix_match.l1_prefix_len\n"
        "                self._unlock_match(decode_req, prefix_match)  # negative control\n",
        tests=(
            R + "unit/disaggregation/test_decode_hicache_admission.py"
            "::TestAdmissionPlanning::test_no_failed_restore_under_host_churn",
        ),
        expected=("test_no_failed_restore_under_host_churn",),
        what="the plan unlocks each prefix it matched before the batch eviction "
        "and the commit",
    ),
    Control(
        name="dp-attention-round-robin",
        level="full",
        module="srt/managers/data_parallel_controller.py",
        old="            LoadBalanceMethod.CACHE_AWARE: self.cache_aware_scheduler,\n",
        new="            LoadBalanceMethod.CACHE_AWARE: self.round_robin_scheduler,\n",
        tests=(
            R + "server/test_cache_aware_routing_dp_attention_server.py"
            "::TestCacheAwareRoutingDpAttentionServer"
            "::test_every_request_routed_once_and_one_digest_per_dp_rank",
            R + "server/test_cache_aware_routing_dp_attention_server.py"
            "::TestCacheAwareRoutingDpAttentionServer::test_conversations_stick_and_hit",
        ),
        expected=("test_every_request_routed_once_and_one_digest_per_dp_rank",),
        what="--load-balance-method cache_aware dispatches round robin",
    ),
    Control(
        name="routed-dp-rank-ignored",
        level="full",
        module="srt/managers/data_parallel_controller.py",
        old="        if req.routed_dp_rank is not None:\n",
        new="        if False:  # negative control: routed_dp_rank ignored\n",
        tests=(
            R + "server/test_cache_aware_routing_dp_attention_server.py"
            "::TestCacheAwareRoutingDpAttentionServer"
            "::test_client_round_robin_control_misses_where_it_moves_a_turn",
        ),
        expected=("test_client_round_robin_control_misses_where_it_moves_a_turn",),
        what="the DP controller ignores routed_dp_rank: the client-side round "
        "robin control is routed by cache",
    ),
    Control(
        name="digest-chunk-256-live",
        level="full",
        module="srt/arg_groups/cache_aware_routing_hook.py",
        old="DEFAULT_DIGEST_CHUNK_TOKENS = 64\n",
        new="DEFAULT_DIGEST_CHUNK_TOKENS = 256  # negative control: the old default\n",
        tests=(
            R + "server/test_cache_aware_routing_server.py"
            "::TestCacheAwareRoutingServer"
            "::test_short_prompts_stick_under_the_default_chunk",
        ),
        expected=("test_short_prompts_stick_under_the_default_chunk",),
        what="the digest chunk default back at 256 tokens: conversations "
        "whose prompts stay under 256 tokens are routed by load",
    ),
    Control(
        name="dp-controller-idle-wait-eats-a-request",
        level="cheap",
        module="srt/managers/data_parallel_controller.py",
        old="                idle_poller.poll(1000)\n",
        new=(
            "                self.recv_from_tokenizer.recv()"
            "  # negative control: dropped\n"
        ),
        tests=(
            R + "unit/managers/test_dp_controller_sleep_on_idle.py"
            "::TestDpControllerSleepOnIdle"
            "::test_an_idle_controller_waits_and_still_dispatches",
        ),
        expected=("test_an_idle_controller_waits_and_still_dispatches",),
        what="the DP controller's idle wait takes the request it waited for: "
        "a request arriving while it is idle never reaches a DP rank",
    ),
    Control(
        name="digest-not-forced-when-idle",
        level="cheap",
        module="srt/managers/dp_routing/publisher.py",
        old="        if not force and now - self._last_check < self.publish_interval:\n",
        new=(
            "        if now - self._last_check < self.publish_interval:"
            "  # negative control\n"
        ),
        tests=(
            R + "unit/managers/test_prefix_digest_publisher.py"
            "::TestPrefixDigestPublisher"
            "::test_going_idle_sends_a_change_within_the_interval",
        ),
        expected=("test_going_idle_sends_a_change_within_the_interval",),
        what="a forced publish (a rank going idle) still waits for the interval",
    ),
    Control(
        name="digest-not-forced-when-idle-live",
        level="full",
        module="srt/managers/scheduler.py",
        old="                self.kv_events_publisher.publish_kv_events, force=True\n",
        new=(
            "                self.kv_events_publisher.publish_kv_events,"
            " force=False  # negative control\n"
        ),
        tests=(
            R + "server/test_cache_aware_routing_dp_attention_server.py"
            "::TestCacheAwareRoutingDpAttentionServer"
            "::test_going_idle_sends_the_digest_the_next_turn_is_routed_by",
        ),
        expected=("test_going_idle_sends_the_digest_the_next_turn_is_routed_by",),
        what="a DP rank going idle leaves its changed digest to the interval",
    ),
    Control(
        name="client-routed-request-not-recorded-live",
        level="full",
        module="srt/managers/data_parallel_controller.py",
        old="            self.cache_aware_router.record_external(\n",
        new="            (lambda *_: None)(  # negative control: not recorded\n",
        tests=(
            R + "server/test_cache_aware_routing_server.py"
            "::TestCacheAwareRoutingServer"
            "::test_router_metrics_on_the_metrics_endpoint",
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_the_control_counts_as_routed_by_the_client",
        ),
        expected=(
            "test_router_metrics_on_the_metrics_endpoint",
            "test_the_control_counts_as_routed_by_the_client",
        ),
        what="requests that name their DP rank are served there but not "
        "counted (live: the client round robin controls, the digest probes)",
    ),
    Control(
        name="decode-credit-at-dispatch-live",
        level="full",
        module="srt/managers/dp_routing/router.py",
        old="        return decode_radix_cache\n",
        new="        return False  # negative control: credit from dispatch\n",
        tests=(
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_a_burst_before_its_decode_landing_is_routed_by_load",
        ),
        expected=("test_a_burst_before_its_decode_landing_is_routed_by_load",),
        what="a PD decode worker credits a dispatched prefix from its dispatch: "
        "the burst's second request follows the first by its match",
    ),
    Control(
        name="dp-scheduler-death-controller-signals-itself",
        level="full",  # a unit test, kept out of CI's cheap set for time (28 s)
        module="srt/managers/data_parallel_controller.py",
        old="                notify_pid=parent_process.pid,\n",
        new="                notify_pid=None,  # negative control: it signals itself\n",
        tests=(R + "unit/managers/test_dp_scheduler_death.py",),
        expected=("did not tell its launcher",),
        what="the DP controller's scheduler watchdog sends SIGQUIT to the "
        "controller, not its launcher (fixes/0011 without its notify_pid)",
    ),
    Control(
        name="mooncake-master-not-probed-live",
        level="full",  # a launcher run that waits out Mooncake's setup retries
        module="srt/mem_cache/storage/mooncake_store/startup_check.py",
        old="    _probe(str(master), field)\n",
        new="    pass  # negative control: the master is not probed\n",
        tests=(R + "server/test_startup_refusals.py",),
        expected=("master_server_address",),
        what="a Mooncake master address nothing listens on is not refused at "
        "server-args resolution (fixes/0023 without its probe)",
    ),
    Control(
        name="valid-stop-token-id-refused",
        level="full",  # a unit test, kept out of CI's cheap set for time (23 s)
        module="srt/sampling/sampling_params.py",
        old="                if not 0 <= token_id < vocab_size:\n",
        new="                if not 0 <= token_id < vocab_size - 1:  # negative control\n",
        tests=(
            R + "unit/managers/test_sampling_field_ranges.py::TestValidRequestsServed",
        ),
        expected=("a valid request was refused",),
        what="a range check refuses a valid value (the last token id as a stop "
        "token id): the valid-request property must fail",
    ),
    Control(
        name="decode-restore-l3-part-counted-as-host",
        level="full",  # a unit test, kept out of CI's cheap set for time
        module="srt/disaggregation/decode_hicache_mixin.py",
        old="        req.storage_hit_length = storage\n",
        new="        req.storage_hit_length = 0  # negative control: no L3 part\n",
        tests=(
            R + "unit/disaggregation/test_decode_restored_prefix_cached_tokens.py"
            "::TestRestoredPrefixCachedTokens"
            "::test_the_l3_part_of_a_restore_counts_as_storage",
        ),
        expected=("test_the_l3_part_of_a_restore_counts_as_storage",),
        what="fixes/0008 without its storage part: a decode restore's L3 span "
        "counts as host hits",
    ),
    Control(
        name="decode-restore-l3-part-counted-as-host-live",
        level="full",
        module="srt/disaggregation/decode_hicache_mixin.py",
        old="        req.storage_hit_length = storage\n",
        new="        req.storage_hit_length = 0  # negative control: no L3 part\n",
        tests=(
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_decode_restores_a_prefix_only_in_l3_and_shares_it",
        ),
        expected=("test_decode_restores_a_prefix_only_in_l3_and_shares_it",),
        what="a live PD decode restore from Mooncake L3 counted as host hits",
    ),
    Control(
        name="decode-output-kv-not-kept-live",
        level="full",
        module="srt/mem_cache/common.py",
        old="        tree_cache.checkpoint(req, up_to=owned_kv_len)\n",
        new=(
            "        tree_cache.checkpoint(req, up_to=min(owned_kv_len,"
            " len(req.origin_input_ids)))  # negative control\n"
        ),
        tests=(
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_prefill_serves_a_next_turn_from_what_decode_put_in_l3",
        ),
        expected=("test_prefill_serves_a_next_turn_from_what_decode_put_in_l3",),
        what="a finished request's tree keeps only its prompt, not the tokens"
        " it generated (nothing of them reaches L3 for the next turn's prefill)",
    ),
    Control(
        name="decode-two-phase-l3-counted-as-host",
        level="full",
        module="srt/disaggregation/decode_hicache_mixin.py",
        old="        storage = prefix_match.l3_storage_hit_length or min(\n",
        new="        storage = prefix_match.l3_storage_hit_length or 0 * min(  "
        "# negative control\n",
        tests=(
            R + "unit/disaggregation/test_decode_hicache_admission.py"
            "::TestTwoPhaseL3Prefetch"
            "::test_two_phase_waits_for_host_then_promises_only_what_landed",
        ),
        expected=("test_two_phase_waits_for_host_then_promises_only_what_landed",),
        what="a two-phase decode L3 restore counted as host hits",
    ),
    Control(
        name="mooncake-condition-logged-per-call",
        level="full",
        module="srt/mem_cache/storage/mooncake_store/health.py",
        old="                if self.code and SEVERITY.index(code) >= "
        "SEVERITY.index(self.code):\n                    return\n",
        new="                pass  # negative control: every failed call logs\n",
        tests=(R + "unit/mem_cache/test_mooncake_l3_faults.py",),
        expected=(
            "test_a_full_store_logs_once_then_recovers",
            "test_a_lost_master_logs_once_then_recovers",
            "test_a_lost_segment_client_logs_once_then_recovers",
        ),
        what="a Mooncake store condition logged once per failed call",
    ),
    Control(
        name="mooncake-condition-ends-at-any-success",
        level="full",
        module="srt/mem_cache/storage/mooncake_store/health.py",
        old="                if not self.code or now - self.last_failure < self.quiet_s:\n",
        new="                if not self.code:  # negative control: no quiet period\n",
        tests=(
            R + "unit/mem_cache/test_mooncake_l3_faults.py::TestMooncakeL3Faults"
            "::test_a_full_store_logs_once_then_recovers",
        ),
        expected=("test_a_full_store_logs_once_then_recovers",),
        what="a store failing and succeeding by turns logged as many conditions",
    ),
    Control(
        name="mooncake-health-not-hooked-live",
        level="full",
        module="srt/mem_cache/storage/mooncake_store/mooncake_store.py",
        old="            self.store = observe_store_health(\n",
        new="            self.store = (lambda store, *_: store)(  # negative control\n",
        tests=(
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_l3_faults_serve_log_one_line_each_and_recover",
        ),
        expected=("test_l3_faults_serve_log_one_line_each_and_recover",),
        what="the Mooncake backend's store calls not observed: no condition line",
    ),
    Control(
        name="prefill-drops-early-decode-abort-live",
        level="full",
        module="srt/disaggregation/mooncake/conn.py",
        old="            if status is None:\n                self._retain_early_abort(room)\n",
        new="            pass  # negative control: an ABORT before the request is dropped\n",
        tests=(
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_a_request_no_decode_pool_can_admit_is_refused_and_prefill_freed",
        ),
        expected=("prefill not freed",),
        what="a PD prefill worker drops a decode ABORT that reaches it before "
        "the request (0.5.23): the request waits for the bootstrap timeout, or,"
        " failed at once by a peer's abort, stays in prefill's bootstrap queue",
    ),
    Control(
        name="kv-events-without-host-tier-live",
        level="full",
        module="srt/mem_cache/rust_tree_core/adapter.py",
        old="            for event in self._binding.take_events()\n        ]\n        return events\n",
        new="            for event in self._binding.take_events()\n        ]\n"
        "        # negative control: the host tier's moves are not published\n"
        '        return [e for e in events if getattr(e, "medium", None) != "CPU_PINNED"]\n',
        tests=(
            R + "server/test_kv_events_tiers_server.py::TestKvEventsPlainHiCache"
            "::test_each_block_of_a_moves_once_per_transition",
            R + "server/test_pd_decode_hicache_server.py::TestPdDecodeHiCacheServer"
            "::test_kv_events_report_the_decode_host_tier_per_rank",
        ),
        expected=(
            "test_each_block_of_a_moves_once_per_transition",
            "test_kv_events_report_the_decode_host_tier_per_rank",
        ),
        what="the KV event publisher of a HiCache server (Rust tree core) "
        "publishes no host-tier move",
    ),
    Control(
        name="router-ignores-host-digests-live",
        level="full",
        module="srt/managers/dp_routing/rank_digests.py",
        old="        return index.update(rank, d.gpu, d.host)\n",
        new="        return index.update(rank, d.gpu, frozenset())  # negative control\n",
        tests=(
            R + "server/test_cache_aware_routing_server.py"
            "::TestCacheAwareRoutingServer::test_small_pool_routes_host_hits",
        ),
        expected=("test_small_pool_routes_host_hits",),
        what="the router indexes no host-tier chunk (live DP=2, small pool)",
    ),
    Control(
        name="native-error-without-envelope",
        level="full",
        module="srt/entrypoints/http_server.py",
        old='        {"error": {"message": str(e)}},\n',
        new='        {"message": str(e)},  # negative control: no error envelope\n',
        tests=(
            R + "server/test_request_fuzz_server.py::TestRequestFuzzServer"
            "::test_every_4xx_answer_has_its_routes_error_shape",
        ),
        expected=("keys ['message']",),
        what="/generate answers a refused request without its error envelope",
    ),
    Control(
        name="serve-cpu-without-host-tier",
        level="full",
        module="srt/mem_cache/unified_radix_cache.py",
        old='        """Execute Backup action."""\n',
        new='        """Execute Backup action."""\n'
        "        return None  # negative control: nothing reaches the host tier\n",
        tests=(
            "tests/tooling/test_serve_cpu.py::TestServeCpu"
            "::test_scheduler_death_then_the_readme_server_on_its_port",
        ),
        expected=("revisit: ",),
        what="HiCache backs nothing up to host memory: no load-back ever",
    ),
)


# ---- the scratch copy ----


def installed_package(python: str) -> Path:
    """The sglang package directory ``python`` imports without PYTHONPATH:
    the installed wheel, never build/src."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; print(u.find_spec('sglang').origin)",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
    )
    if proc.returncode != 0:
        raise ToolError(f"{python} finds no sglang: {proc.stderr.strip()}")
    package = Path(proc.stdout.strip()).parent
    if "site-packages" not in package.parts:
        raise ToolError(f"sglang of {python} is not an installed wheel: {package}")
    return package


class StaleControl(Exception):
    pass


def mutate(text: str, control: Control) -> str:
    count = text.count(control.old)
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times"
        raise StaleControl(
            f"stale control: text {where} in {control.module}: {control.old!r}"
        )
    return text.replace(control.old, control.new)


# Appended to the mutated module: every process that imports it says so.
IMPORT_MARK = """

# negative control (scripts/negative_controls.py): record this import
import os as _negative_control_os

if _negative_control_os.environ.get("NEGATIVE_CONTROL_IMPORTS"):
    with open(
        _negative_control_os.environ["NEGATIVE_CONTROL_IMPORTS"], "a"
    ) as _negative_control_file:
        _negative_control_file.write(f"{_negative_control_os.getpid()} {__file__}\\n")
"""


def scratch_copy(package: Path, root: Path, control: Control) -> Path:
    """``root``/sglang: hard links of ``package`` but the mutated module, a new
    file. Returns the mutated file."""
    if not (package / control.module).is_file():
        raise StaleControl(f"stale control: no module {control.module}")
    text = mutate((package / control.module).read_text(encoding="utf-8"), control)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    target = root / "sglang"
    proc = subprocess.run(
        ["cp", "-al", str(package), str(target)], capture_output=True, text=True
    )
    if proc.returncode != 0:  # another file system: a plain copy
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(package, target, symlinks=True)
    module = target / control.module
    module.unlink()  # the venv's file (same inode) stays as it is
    module.write_text(text + IMPORT_MARK, encoding="utf-8")
    cache = module.parent / "__pycache__"
    for pyc in cache.glob(f"{module.stem}.*.pyc"):
        pyc.unlink()
    shutil.copy(Path(__file__).with_name(f"{PLUGIN}.py"), root / f"{PLUGIN}.py")
    return module


def module_name(control: Control) -> str:
    return "sglang." + control.module[: -len(".py")].replace("/", ".")


# ---- running and judging ----


# ``python -m pytest ARGS`` in a job of the warm interpreter (sys.argv[1:]).
PYTEST_MAIN = "import sys, pytest; raise SystemExit(int(pytest.main(sys.argv[1:])))"


def _run_cold(cmd: list, env: dict, log: Path, timeout: float) -> int | None:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its process group: stopped as a whole
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def run_tests(
    python: str, root: Path, control: Control, timeout: float, warm=None
) -> dict:
    report, imports = root / "report.json", root / "imports.txt"
    for f in (report, imports):
        f.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH")) if p
    )
    env.update(
        NEGATIVE_CONTROL_REPORT=str(report),
        NEGATIVE_CONTROL_IMPORTS=str(imports),
        NEGATIVE_CONTROL_MODULE=module_name(control),
    )
    args = ["-q", "-p", "no:cacheprovider", "-p", PLUGIN, *control.tests]
    log = root / "pytest.log"
    start = time.monotonic()
    if warm is not None:  # forked from the warm interpreter, as python -m pytest
        rc = warm.run(["pytest", *args], ROOT, env, log, timeout, code=PYTEST_MAIN)
    else:
        rc = _run_cold([python, "-m", "pytest", *args], env, log, timeout)
    timed_out = rc is None
    seconds = time.monotonic() - start
    result = dict(rc=rc, seconds=round(seconds, 1), timed_out=timed_out, log=str(log))
    if report.is_file():
        result.update(json.loads(report.read_text()))
    pids = set()
    if imports.is_file():
        for line in imports.read_text().splitlines():
            pid, _, path = line.partition(" ")
            pids.add(pid)
            result.setdefault("imported_from", path)
    result["importing_processes"] = len(pids)
    return result


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:160]
    return ""


def judge(control: Control, result: dict) -> tuple[bool, str]:
    """(failed on its assertion, what was seen)."""
    if result.get("timed_out"):
        return False, "timeout (not counted)"
    if "reports" not in result:
        return False, f"no report (pytest exit {result['rc']}; see its log)"
    if result["collection_errors"]:
        return False, "collection error: " + _first_line(
            result["collection_errors"][0]["message"]
        )
    failures = [r for r in result["reports"] if r["outcome"] == "failed"]
    errors = [r for r in failures if r["kind"] != "assertion"]
    if errors:
        return False, f"{errors[0]['kind']} (not counted): " + _first_line(
            errors[0]["message"]
        )
    if not result["reports"]:
        return False, f"no test ran (pytest exit {result['rc']})"
    if not failures:
        if all(r["outcome"] == "skipped" for r in result["reports"]):
            return False, "skipped (not counted)"
        return False, "PASSED"
    missing = [
        e
        for e in control.expected
        if not any(e in r["nodeid"] or e in r["message"] for r in failures)
    ]
    first = failures[0]
    seen = f"fails on assertion: {first['nodeid'].split('::')[-1]}: " + _first_line(
        first["message"]
    )
    if missing:
        return False, seen + f" (expected failure not seen: {', '.join(missing)})"
    return True, seen


# ---- the table ----


def table(rows: list[tuple]) -> str:
    head = ("control", "test", "expected failure", "seen")
    widths = [
        min(max(len(str(r[i])) for r in [head, *rows]), (40, 70, 60, 200)[i])
        for i in range(4)
    ]

    def line(cells):
        return " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [line(head), "-|-".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def short_test(nodeid: str) -> str:
    path, _, rest = nodeid.partition("::")
    return Path(path).name + (f"::{rest}" if rest else "")


def select(controls, level: str, names: list[str]) -> list[Control]:
    known = {c.name: c for c in controls}
    if names:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ToolError(
                f"unknown control(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        return [known[n] for n in names]
    if level == "all":
        return list(controls)
    return [c for c in controls if c.level == level]


def run_control(control: Control, package: Path, out: Path, python: str, warm):
    """One control: (ok, seen, its summary entry)."""
    root = out / control.name
    original = package / control.module
    before = _sha256(original) if original.is_file() else None
    result: dict = {}
    try:
        scratch_copy(package, root, control)
    except StaleControl as exc:
        ok, seen = False, str(exc)
    else:
        result = run_tests(python, root, control, TIMEOUT_S[control.level], warm)
        ok, seen = judge(control, result)
        if result.get("sglang") and not _under(result["sglang"], root):
            ok = False
            seen += f" (sglang imported from {result['sglang']}, not the copy)"
        elif ok and not result["importing_processes"]:
            ok = False
            seen += " (but no process imported the mutated module)"
    if original.is_file() and _sha256(original) != before:
        raise ToolError(f"the installed {original} changed during {control.name}")
    return dict(
        dataclasses.asdict(control),
        ok=ok,
        seen=seen,
        seconds=result.get("seconds"),
        pytest_exit=result.get("rc"),
        sglang=result.get("sglang"),
        mutated_module=result.get("mutated_module"),
        imported_from=result.get("imported_from"),
        importing_processes=result.get("importing_processes", 0),
        failures=[r for r in result.get("reports", []) if r["outcome"] == "failed"],
        collection_errors=result.get("collection_errors", []),
        log=result.get("log"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=("cheap", "full", "all"), default="all")
    parser.add_argument("--control", action="append", default=[], metavar="NAME")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--controls-json", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="a fresh interpreter per control, not a fork of the warm one",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        metavar="N",
        help="controls run at once (default: one per core for --set cheap, "
        "where each runs unit tests in one process; one at a time otherwise, "
        "where live servers take every core)",
    )
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    if args.jobs < 0:
        parser.error(f"--jobs {args.jobs}: must be 0 (the default) or more")
    jobs = args.jobs or ((os.cpu_count() or 1) if args.set == "cheap" else 1)
    names = [n for arg in args.control for n in arg.split(",") if n]

    controls = CONTROLS
    if args.controls_json:
        controls = tuple(
            Control.from_dict(d) for d in json.loads(args.controls_json.read_text())
        )
    for c in controls:
        if c.level not in LEVELS:
            raise ToolError(f"control {c.name}: level {c.level!r} not in {LEVELS}")
    chosen = select(controls, args.set, names)
    if args.list:
        for c in chosen:
            print(f"{c.name:34} {c.level:5} {c.module}: {c.what}")
        return 0

    package = installed_package(args.python)
    print(f"installed sglang: {package}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    warm_ok = not args.cold and (
        Path(args.python).resolve() == Path(sys.executable).resolve()
    )
    jobs = max(1, min(jobs, len(chosen)))
    done = [0]
    with contextlib.ExitStack() as stack:
        # Third-party imports paid once; sglang comes from each copy. The warm
        # interpreter runs the jobs' controls side by side.
        warm = None
        if warm_ok:
            warm = stack.enter_context(WarmPython(THIRD_PARTY + ("pytest",)))
        lock = threading.Lock()

        def one(control):
            entry = run_control(control, package, args.out, args.python, warm)
            with lock:
                done[0] += 1
                print(
                    f"[{done[0]}/{len(chosen)}] {control.name}: "
                    f"{'ok' if entry['ok'] else 'NOT OK'} in "
                    f"{entry['seconds'] or 0:.0f} s; test process imported "
                    f"{_rel(entry['sglang'])}; mutated module imported by "
                    f"{entry['importing_processes']} process(es)",
                    flush=True,
                )
            return entry

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            summary = list(pool.map(one, chosen))  # in the order chosen
    elapsed = time.monotonic() - start
    rows = [
        (
            c["name"],
            ", ".join(short_test(t) for t in c["tests"]),
            " + ".join(c["expected"]),
            c["seen"],
        )
        for c in summary
    ]
    print()
    print(table(rows))
    failed = [c["name"] for c in summary if not c["ok"]]
    (args.out / "summary.json").write_text(
        json.dumps(
            dict(controls=summary, seconds=round(elapsed, 1), not_ok=failed), indent=1
        )
        + "\n"
    )
    print(
        f"\n{len(summary) - len(failed)} of {len(summary)} controls failed on their "
        f"assertions in {elapsed:.0f} s; summary: {_rel(str(args.out / 'summary.json'))}"
    )
    if failed:
        print(f"not failing on an assertion: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _under(path: str | None, root: Path) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(root.resolve())


def _rel(path: str | None) -> str:
    if path is None:
        return "no sglang"
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


if __name__ == "__main__":
    run_main(lambda: sys.exit(main()))
