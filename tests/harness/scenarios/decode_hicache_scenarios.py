"""Decode-side HiCache scenarios, run against unpatched upstream and the patched
tree (``harness.compare.run_scenario``) on gloo ranks.

``seed_flag=True`` passes ``--disaggregation-decode-enable-hicache`` (only the
patched tree knows it); without it both trees must behave identically.
``tree_core`` picks the radix tree core, ``"python"`` or ``"rust"`` (0.5.23's
default); every scenario runs on either.
"""

from __future__ import annotations

import argparse
import functools
import random

import torch

from harness.scenarios.hicache_l2_scenarios import sglang_identity

UPSTREAM_TEST_MODULE = "sglang.test.decode_hicache_scenarios"


@functools.cache
def _server_args_parser():
    """The real ServerArgs command line (argument errors raise, not exit)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def require_decode_hicache() -> None:
    """The first check of every decode-hicache PR test, made before any of
    the PR's modules is imported: ``--disaggregation-decode-enable-hicache``
    parses on the real ServerArgs parser. Without the PR it fails by this
    assertion, not by an import error or argparse's exit."""
    parser = _server_args_parser()
    argv = ["--model-path", "dummy", "--disaggregation-decode-enable-hicache"]
    args, unknown = parser.parse_known_args(argv)
    if (
        unknown
        or getattr(args, "disaggregation_decode_enable_hicache", None) is not True
    ):
        raise AssertionError(
            "--disaggregation-decode-enable-hicache does not parse "
            f"(left over: {unknown}): the decode-hicache PR is missing"
        )


def _stack(rank, world_size, seed_flag, **kw):
    from harness.stacks.decode_hicache_stack import build_decode_stack

    overrides = dict(kw.pop("server_args_overrides", {}) or {})
    if seed_flag:
        overrides["disaggregation_decode_enable_hicache"] = True
    return build_decode_stack(rank, world_size, server_args_overrides=overrides, **kw)


def host_span_restore(
    rank: int,
    world_size: int,
    *,
    seed_flag: bool,
    evict_host_first: bool = True,
    abort_queued: bool = False,
    abort_restoring: bool = False,
    swap_restored_rows: bool = False,
    tree_core: str = "python",
) -> dict:
    """A prefix cached only in host memory is promised to prefill; host
    eviction runs before the restore is queued (host pressure from other
    write-throughs); then the restore runs. ``abort_queued`` aborts the
    request before admission, ``abort_restoring`` while its restore waits.
    Negative control of the byte check: ``swap_restored_rows`` swaps the
    first two restored device rows (a restore that misplaced them)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from harness.stacks.decode_hicache_stack import random_tokens

    stack = _stack(rank, world_size, seed_flag, size=1024, tree_core=tree_core)
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    prefix = random_tokens(rng, 256)
    cached = stack.cache_prefix(prefix, gen)
    evicted_device = stack.evict_device(256)
    start = stack.snapshot()

    dr = stack.make_request("r0", prefix + random_tokens(rng, 64))
    stack.prealloc.queue.append(dr)
    if abort_queued:
        dr.req.finished_reason = FINISH_ABORT("client abort (test)")
        admitted, failed = stack.admit()
        return dict(
            admitted=[d.req.rid for d in admitted],
            failed=[d.req.rid for d in failed],
            start=start,
            after=stack.snapshot(),
            host_lock_refs=_host_lock_refs(stack),
            sglang=sglang_identity(),
        )
    admitted, _ = stack.admit()
    pm = dr.prefix_match
    out = dict(
        evicted_device=evicted_device,
        admitted=[d.req.rid for d in admitted],
        promised=dr.kv_receiver.metadata["decode_prefix_len"],
        l1=pm.l1_prefix_len,
        l2=pm.l2_host_hit_length,
        host_locked=getattr(pm, "host_span_lock", None) is not None,
    )
    if abort_restoring:  # the restore is still waiting for a load slot
        out["status"] = dr.hicache_restore_status.value
        stack.abort_in_transfer(dr)
        out.update(
            start=start,
            after=stack.snapshot(),
            host_lock_refs=_host_lock_refs(stack),
            sglang=sglang_identity(),
        )
        return out
    out["host_evicted"] = stack.evict_host(10_000) if evict_host_first else 0
    out["status"] = _run_restore(stack, dr)
    if swap_restored_rows and dr.hicache_restored_kv_indices is not None:
        a, b = dr.hicache_restored_kv_indices[:2].tolist()
        for buf in stack.pool.kv_buffer:
            buf[[a, b]] = buf[[b, a]].clone()
    _finish_or_abort(stack, dr, cached, out)
    out["after"] = stack.snapshot()
    out["host_lock_refs"] = _host_lock_refs(stack)
    out["sglang"] = sglang_identity()
    return out


def short_host_span(
    rank: int,
    world_size: int,
    *,
    host_tokens: int,
    page_size: int = 4,
    tree_core: str = "python",
) -> dict:
    """A request whose prefix match is ``host_tokens`` tokens held only in
    host memory (its device copy evicted), nothing on the device: what the
    decode worker promises prefill, and how the restore ends. The tree loads
    back no host span shorter than its ``load_back_threshold``."""
    from harness.stacks.decode_hicache_stack import random_tokens

    stack = _stack(
        rank, world_size, False, size=1024, page_size=page_size, tree_core=tree_core
    )
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    prefix = random_tokens(rng, host_tokens)
    cached = stack.cache_prefix(prefix, gen)
    evicted_device = stack.evict_device(host_tokens)
    dr = stack.make_request("r0", prefix + random_tokens(rng, 4 * page_size))
    stack.prealloc.queue.append(dr)
    admitted, _ = stack.admit()
    out = dict(
        threshold=stack.cache.load_back_threshold,
        evicted_device=evicted_device,
        admitted=[d.req.rid for d in admitted],
        promised=dr.kv_receiver.metadata["decode_prefix_len"],
    )
    out["status"] = _run_restore(stack, dr)
    _finish_or_abort(stack, dr, cached, out)
    out["after"] = stack.snapshot()
    return out


def _run_restore(stack, dr, ticks: int = 20) -> str:
    """Tick the restore state machine until the request leaves ``pending``
    (bounded); its status."""
    for _ in range(ticks):
        stack.restore_tick()
        if dr.hicache_restore_status.value != "pending":
            break
    return dr.hicache_restore_status.value


def _finish_or_abort(stack, dr, cached, out) -> None:
    """Check the restored rows against the cached ones (prefix order), then
    release the request as a finished one, or abort it on a failed restore."""
    if out["status"] != "ready":
        stack.abort_in_transfer(dr)
        return
    restored = dr.hicache_restored_kv_indices
    if restored is None:
        out["restored_bytes_equal"] = None  # nothing to restore (L1 only)
    else:
        start = dr.prefix_match.l1_prefix_len
        rows = stack.device_rows(restored)
        out["restored_bytes_equal"] = all(
            torch.equal(a, b[start : start + len(restored)])
            for a, b in zip(rows, cached["rows"])
        )
    stack.finish(dr)
    # the restored span's storage part, as cached_tokens_details reports it
    out["storage_hit_length"] = getattr(dr.req, "storage_hit_length", None)


def _host_lock_refs(stack) -> int:
    """Host lock refs left in the tree. The Python core's are summed over its
    nodes (and checked against the receipt count: both zero or both not);
    the Rust core's binding has no per-node view, so there it is the host-lock
    receipts still outstanding (``HostLockCounter``)."""
    outstanding = stack.host_locks.outstanding
    if stack.tree_core != "python":
        return outstanding
    total = 0
    todo = [stack.cache.tree_core.root_node]
    while todo:
        node = todo.pop()
        total += sum(cd.host_lock_ref for cd in node.component_data)
        todo.extend(node.children.values())
    assert (total == 0) == (outstanding == 0), (total, outstanding)
    return total


# benchmark/decode_hicache's "host-churn" configuration of ``admission_sim``:
# 512 tokens of other traffic written through to host per step, restores
# ticked every 4th step; 0.5.23's admission fails restores on it.
HOST_CHURN = dict(
    size=1536,
    hicache_ratio=1.2,
    host_churn_tokens=512,
    restore_every=4,
    steps=20,
    arrivals=(1, 4),
    num_prefixes=10,
    lifetime=(4, 8),
)


def admission_sim(
    rank: int,
    world_size: int,
    *,
    seed_flag: bool,
    seed: int = 0,
    steps: int = 30,
    size: int = 2048,
    hicache_ratio: float = 2.0,
    num_prefixes: int = 6,
    prefix_pages: tuple = (8, 24),
    suffix_pages: tuple = (1, 4),
    arrivals: tuple = (1, 4),
    lifetime: tuple = (2, 5),
    host_churn_tokens: int = 0,
    restore_every: int = 1,
    consensus_checker: bool = False,
    diverge_rank: int | None = None,
    tree_core: str = "python",
) -> dict:
    """Decode admission under device and host memory pressure: requests share
    a few long prefixes; each step some arrive, ``pop_preallocated`` admits,
    the restore state machine ticks, admitted requests finish after a few
    steps and are released into the tree; ``host_churn_tokens`` of unrelated
    traffic are cached (written through to host) per step between admission
    and the restore tick, which runs every ``restore_every`` steps (load-back
    slots busy). Every input is drawn from ``seed``
    alone, so all ranks see the same workload. Returns per-step counts and
    the per-step plan digests (patched tree, ``seed_flag=True``)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from harness.stacks.decode_hicache_stack import random_tokens

    if consensus_checker:
        from types import SimpleNamespace

        import torch.distributed as dist
        from sglang.srt.utils import rank_consensus_checker

    stack = _stack(
        rank,
        world_size,
        seed_flag,
        size=size,
        max_reqs=32,
        server_args_overrides=dict(hicache_ratio=hicache_ratio),
        tree_core=tree_core,
    )
    if consensus_checker:
        rank_consensus_checker.configure([SimpleNamespace(cpu_group=dist.group.WORLD)])
    ps = stack.page_size
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prefixes = [
        random_tokens(rng, rng.randint(*prefix_pages) * ps) for _ in range(num_prefixes)
    ]
    for p in prefixes[: num_prefixes // 2]:
        stack.cache_prefix(p, gen)
    if rank == diverge_rank:  # negative control: only this rank's budget differs
        stack.prealloc.num_reserved_decode_tokens += 4 * ps
    evictions = {"calls": 0, "tokens": 0}
    original_evict_for_alloc = stack.cache.evict_for_alloc

    def counting_evict_for_alloc(params, **kw):  # call-through counter
        result = original_evict_for_alloc(params, **kw)
        evictions["calls"] += 1
        evictions["tokens"] += result.num_tokens_evicted
        return result

    stack.cache.evict_for_alloc = counting_evict_for_alloc
    plans = []
    if seed_flag:
        original_plan = stack.prealloc._plan_prealloc_batch

        def recording_plan(*a, **kw):  # call-through recorder
            plan = original_plan(*a, **kw)
            plans.append((plan.summary(), plan.evict_tokens, len(plan.entries)))
            return plan

        stack.prealloc._plan_prealloc_batch = recording_plan

    # The workload is drawn up front, so it does not depend on admissions.
    schedule = []
    n = 0
    for step in range(steps):
        batch = []
        for _ in range(rng.randint(*arrivals)):
            prompt = rng.choice(prefixes) + random_tokens(
                rng, rng.randint(*suffix_pages) * ps
            )
            batch.append((f"r{n}", prompt, rng.randint(*lifetime)))
            n += 1
        churn = random_tokens(rng, host_churn_tokens) if host_churn_tokens else None
        schedule.append((batch, churn))

    running = []  # (finish_step, decode_req)
    per_step = []
    totals = dict(
        arrived=0,
        admitted=0,
        failed_restores=0,
        promised_tokens=0,
        input_tokens=0,
        l1_tokens=0,
        l2_tokens=0,
    )
    arrival_step = {}
    life = {}
    wait_steps = []
    for step in range(steps):
        batch, churn = schedule[step]
        for rid, prompt, lifetime_steps in batch:
            dr = stack.make_request(rid, prompt, max_new_tokens=4)
            arrival_step[rid] = step
            life[rid] = lifetime_steps
            stack.prealloc.queue.append(dr)
            totals["arrived"] += 1
        calls_before = evictions["calls"]
        admitted, _ = stack.admit()
        admit_evict_calls = evictions["calls"] - calls_before
        for dr in admitted:
            pm = dr.prefix_match
            totals["admitted"] += 1
            totals["input_tokens"] += len(dr.req.origin_input_ids)
            totals["promised_tokens"] += dr.kv_receiver.metadata["decode_prefix_len"]
            totals["l1_tokens"] += pm.l1_prefix_len if pm else 0
            totals["l2_tokens"] += pm.l2_host_hit_length if pm else 0
            wait_steps.append(step - arrival_step[dr.req.rid])
            running.append((step + life[dr.req.rid], dr))
        # Requests finishing in the running batch are released (inserted and
        # written through to host) before the transfer queue's next restore
        # tick, as between two scheduler iterations.
        done = [(t, dr) for t, dr in running if t <= step]
        for t, dr in done:
            for _ in range(50):
                if dr.hicache_restore_status.value != "pending":
                    break
                stack.restore_tick()
            running.remove((t, dr))
            if dr.hicache_restore_status.value == "ready":
                stack.finish(dr)
            else:
                totals["failed_restores"] += 1
                stack.abort_in_transfer(dr)
        if churn:
            stack.cache_prefix(churn, gen, required=False)
        stack.cache.check_hicache_events()
        if step % restore_every == 0:
            stack.restore_tick()
        per_step.append(
            dict(
                admitted=len(admitted),
                admit_evict_calls=admit_evict_calls,
                evict_calls=evictions["calls"] - calls_before,
                queued=len(stack.prealloc.queue),
            )
        )
    # Drain: finish what is running, drop what is queued.
    for t, dr in running:
        for _ in range(50):
            if dr.hicache_restore_status.value != "pending":
                break
            stack.restore_tick()
        if dr.hicache_restore_status.value == "ready":
            stack.finish(dr)
        else:
            totals["failed_restores"] += 1
            stack.abort_in_transfer(dr)
    totals.update(
        evict_calls=evictions["calls"],
        evicted_tokens=evictions["tokens"],
        queued_at_end=len(stack.prealloc.queue),
        mean_wait_steps=sum(wait_steps) / max(1, len(wait_steps)),
    )
    assert isinstance(stack.cache, UnifiedRadixCache)
    return dict(
        totals=totals,
        per_step=per_step,
        plans=plans,
        host_lock_refs=_host_lock_refs(stack),
        after=stack.snapshot(),
        protected=int(stack.cache.protected_size()),
        sglang=sglang_identity(),
    )


def _l3_stack(rank, world_size, seed_flag, storage_dir, policy, tree_core):
    import os

    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = storage_dir
    stack = _stack(
        rank,
        world_size,
        seed_flag,
        size=1024,
        server_args_overrides=dict(
            hicache_storage_backend="file",
            hicache_storage_prefetch_policy=policy,
        ),
        tree_core=tree_core,
    )
    cc = stack.cache.cache_controller
    if getattr(cc, "rank_shard", None) is not None:
        # The scheduler sets the load fence on every HiCache controller.
        cc.load_fence_stream = torch.cpu.current_stream()
    return stack


def _settle_storage(stack, ticks: int = 250) -> None:
    """Polls the cache's events until no write-through, storage backup,
    prefetch or load-back is in flight, at most ``ticks`` polls 20 ms apart.
    Each of those is retired by counts all-reduced with MIN, so every rank
    leaves the loop at the same poll (the same number of collectives)."""
    import time

    cache = stack.cache
    for _ in range(ticks):
        cache.check_hicache_events()
        if not (
            cache.ongoing_write_through
            or cache.ongoing_backup
            or cache.ongoing_prefetch
            or cache.ongoing_load_back
        ):
            return
        time.sleep(0.02)


def l3_two_phase(
    rank: int,
    world_size: int,
    *,
    seed_flag: bool,
    storage_dir: str,
    policy: str = "wait_complete",
    abort_while_prefetching: bool = False,
    max_steps: int = 100,
    prefix_tokens: int = 256,
    tree_core: str = "python",
    slow_rank: int | None = None,
    drop_shard: tuple[int, int] | None = None,
    variant: str | None = None,
) -> dict:
    """A prefix that lives only in L3 storage (file backend): written through
    to host and storage, then evicted from device and host. A request for it
    is admitted; ``seed_flag=True`` holds it until the L3 -> L2 prefetch lands.

    For a group of TP ranks: ``slow_rank``'s L3 reads take 0.3 s a batch
    longer; ``drop_shard=(rank, page)`` deletes that rank's object of that
    page (a rank-sharded tier stores one object per rank and page) before
    the request. Negative control (``variant``): ``same_key`` gives every
    rank of a rank-sharded group rank 0's object key."""
    import time

    import torch.distributed as dist
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from harness.stacks.decode_hicache_stack import random_tokens

    stack = _l3_stack(rank, world_size, seed_flag, storage_dir, policy, tree_core)
    cc = stack.cache.cache_controller
    shard = getattr(cc, "rank_shard", None)  # hicache-rank-shard
    if variant == "same_key":
        from sglang.srt.mem_cache.hicache_rank_shard.storage import shard_key_suffix

        backend = cc.storage_backend
        backend.config_suffix = backend.config_suffix.replace(
            shard.l3.key_suffix, shard_key_suffix(world_size, 0)
        )
    if rank == slow_rank:
        get = cc.page_get_func

        def slow_get(*args, **kwargs):
            time.sleep(0.3)
            return get(*args, **kwargs)

        cc.page_get_func = slow_get
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    prefix = random_tokens(rng, prefix_tokens)
    cached = stack.cache_prefix(prefix, gen)
    _settle_storage(stack)
    evicted = (stack.evict_device(prefix_tokens), stack.evict_host(10_000))
    dropped = _drop_shard(stack, storage_dir, prefix, drop_shard, world_size)
    start = stack.snapshot()
    l3_read_before = shard.l3.bytes_read if shard is not None else None

    dr = stack.make_request("r0", prefix + random_tokens(rng, 64))
    stack.prealloc.queue.append(dr)
    out = dict(
        evicted=evicted,
        admitted_at=None,
        sglang=sglang_identity(),
        sharded=shard is not None,
        dropped=dropped,
    )
    t0 = time.perf_counter()
    for step in range(max_steps):
        admitted, failed = stack.admit()
        stack.cache.check_hicache_events()
        if admitted:
            out["admitted_at"] = step
            out["seconds_to_admit"] = time.perf_counter() - t0
            break
        if failed:
            out["aborted_at"] = step
            break
        if abort_while_prefetching and step == 0:
            out["pending_before_abort"] = bool(
                getattr(dr, "hicache_prefetch_pending", False)
            )
            dr.req.finished_reason = FINISH_ABORT("client abort (test)")
        time.sleep(0.02)
    if out["admitted_at"] is None:
        _settle_storage(stack)
        out["ongoing_prefetch"] = len(stack.cache.ongoing_prefetch)
        out["after"] = stack.snapshot()
        out["start"] = start
        out["host_lock_refs"] = _host_lock_refs(stack)
        return out
    pm = dr.prefix_match
    out.update(
        promised=dr.kv_receiver.metadata["decode_prefix_len"],
        l1=pm.l1_prefix_len,
        l2=pm.l2_host_hit_length,
        l3=pm.l3_storage_hit_length,
    )
    for _ in range(200):
        stack.restore_tick()
        stack.cache.check_hicache_events()
        if dr.hicache_restore_status.value != "pending":
            break
        time.sleep(0.01)
    out["status"] = dr.hicache_restore_status.value
    out["seconds_to_outcome"] = time.perf_counter() - t0
    _finish_or_abort(stack, dr, cached, out)
    _settle_storage(stack)
    out["host_lock_refs"] = _host_lock_refs(stack)
    if shard is not None:
        out["l3_bytes_read"] = shard.l3.bytes_read - l3_read_before
        out["kv_host_layers"] = list(
            cc.mem_pool_host.get_pool(PoolName.KV)._target_layer_indices
        )
    if world_size > 1:
        out["tree"] = _tree_state(stack.cache)
        dist.barrier()
    return out


def _drop_shard(stack, storage_dir, prefix, drop_shard, world_size) -> list:
    """Rank 0 deletes ``drop_shard=(rank, page)``'s storage object of that
    page of ``prefix`` (every rank waits for it). Returns the names deleted."""
    import os

    import torch.distributed as dist

    if drop_shard is None:
        return []
    from sglang.srt.mem_cache.hicache_rank_shard.storage import shard_key_suffix
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    owner, page = drop_shard
    page_hash = get_storage_hash_str(prefix, None, page_size=stack.page_size)[page]
    suffix = shard_key_suffix(world_size, owner) + ".bin"
    doomed = sorted(
        name
        for name in os.listdir(storage_dir)
        if name.startswith(page_hash + "_") and name.endswith(suffix)
    )
    dist.barrier()
    if dist.get_rank() == 0:
        for name in doomed:
            os.remove(os.path.join(storage_dir, name))
    dist.barrier()
    return doomed


def _rust_tree_dump(core) -> str:
    """The Rust binding's ``pretty_print`` (node ids, key lengths, device lock
    refs, device residency), captured from fd 1 where the extension prints."""
    import os
    import sys
    import tempfile

    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 1)
        try:
            core._binding.pretty_print()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read().decode()


def _tree_state(cache):
    core = cache.tree_core
    if not _is_python_core(core):
        # Rust core: structure (a split shows), device lock refs, sizes.
        return (
            _rust_tree_dump(core),
            int(cache.evictable_size()),
            int(cache.protected_size()),
            int(cache.cache_controller.mem_pool_host.available_size()),
        )
    out = []
    todo = [core.root_node]
    while todo:
        node = todo.pop()
        out.append(
            (
                node.id,
                len(node.key) if node.key is not None else 0,
                node.last_access_time,
                node.evicted,
                node.backuped,
                tuple((cd.lock_ref, cd.host_lock_ref) for cd in node.component_data),
            )
        )
        todo.extend(node.children.values())
    return sorted(out, key=lambda t: t[0])


def _is_python_core(core) -> bool:
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    return isinstance(core, UnifiedTreeCore)


def peek_vs_match(
    rank: int,
    world_size: int,
    *,
    seed: int = 0,
    rounds: int = 60,
    tree_core: str = "python",
):
    """``peek_prefix`` reports the device length ``match_prefix`` reports and
    changes nothing:
    random prefixes cached, partly evicted to host and from host, then probed
    with queries that end inside nodes (forcing ``match_prefix`` to split).
    ``device_checked`` counts the rounds where both agree; ``match_changed``
    the rounds whose ``match_prefix`` changed the state probe (its control:
    a split or an LRU move on the Python core, a split on the Rust one,
    whose probe sees no LRU order). ``lru`` then
    probes the LRU: of two prefixes cached in turn, one device eviction drops
    the older one unless probing it touched the LRU."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from harness.stacks.decode_hicache_stack import random_tokens

    stack = _stack(rank, world_size, False, size=2048, tree_core=tree_core)
    ps = stack.page_size
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bases = [random_tokens(rng, rng.randint(4, 12) * ps) for _ in range(4)]
    device_checked = unchanged = match_changed = 0
    kinds = set()
    for _ in range(rounds):
        op = rng.random()
        if op < 0.4:
            base = rng.choice(bases)
            cut = rng.randint(1, len(base) // ps) * ps
            stack.cache_prefix(
                base[:cut] + random_tokens(rng, rng.randint(1, 6) * ps), gen
            )
        elif op < 0.6:
            stack.evict_device(rng.randint(1, 8) * ps)
        elif op < 0.7:
            stack.evict_host(rng.randint(1, 4) * ps)
        base = rng.choice(bases)
        query = base[: rng.randint(1, len(base))] + random_tokens(
            rng, rng.randint(0, 20)
        )
        key = RadixKey(array("q", query))
        before = _tree_state(stack.cache)
        peek = stack.cache.peek_prefix(key)
        unchanged += _tree_state(stack.cache) == before
        m = stack.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", query))))
        match_changed += _tree_state(stack.cache) != before  # the probe's control
        device_checked += peek == m.device_prefix_len
        kinds.add((peek > 0, m.host_hit_length > 0))

    def key(tokens):
        return RadixKey(array("q", tokens))

    def lru_probe(touch) -> tuple:
        stack.evict_device(10**6)
        older, newer = random_tokens(rng, 4 * ps), random_tokens(rng, 4 * ps)
        stack.cache_prefix(older, gen)
        stack.cache_prefix(newer, gen)
        touch(older)
        stack.evict_device(4 * ps)
        return tuple(stack.cache.peek_prefix(key(t)) for t in (older, newer))

    lru = dict(
        peek=lru_probe(lambda t: stack.cache.peek_prefix(key(t[: 2 * ps + 3]))),
        match=lru_probe(lambda t: stack.cache.match_prefix(MatchPrefixParams(key(t)))),
    )
    return dict(
        rounds=rounds,
        device_checked=device_checked,
        unchanged=unchanged,
        match_changed=match_changed,
        kinds=sorted(kinds),
        lru=lru,
    )


def _stack_with_cached_prefixes(rank, world_size, seed, pages, tree_core, count=3):
    """A patched decode stack with ``count`` random prefixes of ``pages`` pages
    cached (device and host); returns the stack, the seeded token RNG (for
    the caller's further tokens) and the prefixes."""
    from harness.stacks.decode_hicache_stack import random_tokens

    stack = _stack(rank, world_size, True, size=1024, tree_core=tree_core)
    ps = stack.page_size
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prefixes = [random_tokens(rng, pages * ps) for _ in range(count)]
    for p in prefixes:
        stack.cache_prefix(p, gen)
    return stack, rng, prefixes


def planned_then_released(
    rank: int, world_size: int, *, seed: int = 4, tree_core: str = "python"
) -> dict:
    """Abort in the planned phase: plan a batch (matches locked, host spans
    locked, batch eviction done), release it without committing, then admit
    the same requests through pop_preallocated."""
    from harness.stacks.decode_hicache_stack import random_tokens

    stack, rng, prefixes = _stack_with_cached_prefixes(
        rank, world_size, seed, 12, tree_core
    )
    ps = stack.page_size
    stack.evict_device(12 * ps)  # one prefix is host-only now
    start = stack.snapshot()
    reqs = [
        stack.make_request(f"r{i}", p + random_tokens(rng, 2 * ps))
        for i, p in enumerate(prefixes)
    ]
    stack.prealloc.queue.extend(reqs)
    plan = stack.prealloc._plan_prealloc_batch(
        list(reqs),
        retractable_tokens=0,
        reserved_restore_tokens=0,
        slots=8,
    )
    planned = dict(
        entries=len(plan.entries),
        host_spans=sum(
            e.prefix_match.host_span_lock is not None for e in plan.entries.values()
        ),
        protected=int(stack.cache.protected_size()),
        host_lock_refs=_host_lock_refs(stack),
    )
    stack.prealloc._release_planned(plan)
    released = dict(
        protected=int(stack.cache.protected_size()),
        host_lock_refs=_host_lock_refs(stack),
        snapshot=stack.snapshot(),
    )
    admitted, _ = stack.admit()
    return dict(
        start=start,
        planned=planned,
        released=released,
        admitted=[d.req.rid for d in admitted],
    )


def head_of_queue_admission(
    rank: int, world_size: int, *, seed_flag: bool, rounds=3, tree_core: str = "python"
):
    """An idle decode worker whose queue head needs a large decode headroom
    (max_new_tokens) while the next request reuses a large cached prefix:
    the admission check of the head must see the budget greedy would see
    (only its own and earlier prefixes locked)."""
    from harness.stacks.decode_hicache_stack import random_tokens

    stack = _stack(rank, world_size, seed_flag, size=1024, tree_core=tree_core)
    rng = random.Random(21)
    gen = torch.Generator().manual_seed(21)
    p, q = random_tokens(rng, 576), random_tokens(rng, 256)
    stack.cache_prefix(p, gen)
    stack.cache_prefix(q, gen)
    r1 = stack.make_request("r1", random_tokens(rng, 96), max_new_tokens=900)
    r2 = stack.make_request("r2", p + random_tokens(rng, 64), max_new_tokens=4)
    stack.prealloc.queue.extend([r1, r2])
    admitted = [[d.req.rid for d in stack.admit()[0]] for _ in range(rounds)]
    return dict(
        admitted=admitted,
        queued=[d.req.rid for d in stack.prealloc.queue],
        host_lock_refs=_host_lock_refs(stack),
        sglang=sglang_identity(),
    )


def plan_digest(
    rank: int,
    world_size: int,
    *,
    diverge_rank=None,
    seed: int = 4,
    tree_core: str = "python",
):
    """One plan over a queue whose prefixes are partly cached; returns the
    plan digest that ranks compare (``diverge_rank`` reserves more decode
    tokens per request on that rank only)."""
    from harness.stacks.decode_hicache_stack import random_tokens

    stack, rng, prefixes = _stack_with_cached_prefixes(
        rank, world_size, seed, 16, tree_core
    )
    ps = stack.page_size
    if rank == diverge_rank:
        stack.prealloc.num_reserved_decode_tokens += 8 * ps
    reqs = [
        stack.make_request(f"r{i}", p + random_tokens(rng, 4 * ps))
        for i, p in enumerate(prefixes * 2)
    ]
    plan = stack.prealloc._plan_prealloc_batch(
        reqs, retractable_tokens=0, reserved_restore_tokens=0, slots=8
    )
    return dict(
        digest=plan.summary(), entries=len(plan.entries), evict=plan.evict_tokens
    )


def never_fitting_request(
    rank: int,
    world_size: int,
    *,
    seed_flag: bool = False,
    prompt_tokens: int,
    reserved: int = 512,
    rounds: int = 3,
    tree_core: str = "python",
) -> dict:
    """An idle decode worker (1024-token pool, pages of 16, ``reserved`` decode
    tokens reserved per request, 512 as upstream's default) whose queue head
    is a ``prompt_tokens`` request, followed by a 64-token one; ``rounds``
    admission rounds. A request is admitted once its page-aligned prompt plus
    the reservation fit the free pool, so a head whose need exceeds the whole
    pool can never be admitted. Records what the client is streamed and
    whether the KV receiver told prefill (``abort``)."""
    from types import SimpleNamespace

    from harness.stacks.decode_hicache_stack import random_tokens

    stack = _stack(
        rank,
        world_size,
        seed_flag,
        size=1024,
        num_reserved_decode_tokens=reserved,
        tree_core=tree_core,
    )
    streamed = []
    stack.prealloc.scheduler.output_streamer = SimpleNamespace(
        stream_output=lambda reqs, *a, **k: streamed.extend(r.rid for r in reqs)
    )
    rng = random.Random(5)
    head = stack.make_request("head", random_tokens(rng, prompt_tokens))
    small = stack.make_request("small", random_tokens(rng, 64))
    receiver = head.kv_receiver
    start = stack.snapshot()
    stack.prealloc.queue.extend([head, small])
    admitted, failed = [], []
    for _ in range(rounds):
        a, f = stack.admit()
        admitted.append([d.req.rid for d in a])
        failed.append([d.req.rid for d in f])
    reason = head.req.finished_reason
    return dict(
        pool=stack.prealloc.max_total_num_tokens,
        page_size=stack.page_size,
        admitted=admitted,
        failed=failed,
        queued=[d.req.rid for d in stack.prealloc.queue],
        streamed=streamed,
        finished_reason=None if reason is None else reason.to_json(),
        receiver_aborted=receiver.aborted,
        receiver_cleared=head.kv_receiver is None,
        head_holds_kv=head.req.kv.req_pool_idx is not None,
        start=start,
        after=stack.snapshot(),
        host_lock_refs=_host_lock_refs(stack),
        sglang=sglang_identity(),
    )


def restored_prefix_cached_tokens(
    rank: int,
    world_size: int,
    *,
    device_tokens: int = 128,
    host_tokens: int = 128,
    prefill_cached: int = 0,
    tree_core: str = "python",
    storage_tokens: int = 0,
    storage_dir: str | None = None,
) -> dict:
    """The cached-token breakdown a client is given for a decode request whose
    prefix match is ``device_tokens`` on the device, then ``host_tokens``
    only in host memory (upstream's flags: decode radix cache + HiCache), then
    ``storage_tokens`` only in L3 (``storage_dir``: the ``file`` backend,
    prefetched with ``wait_complete``). The
    request is admitted and restored, its transfer committed by
    ``_commit_transfer_to_req`` from a real ``MetadataBuffers`` slot that
    prefill filled (``prefill_cached`` tokens, all device hits there), and it
    enters the running batch through ``prepare_for_prebuilt`` as
    ``_get_new_prebuilt_batch`` builds it."""
    import time
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import MetadataBuffers
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.output_streamer import (
        SchedulerOutputStreamer,
    )
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from harness.stacks.decode_hicache_stack import random_tokens

    if storage_dir is None:
        assert not storage_tokens, "storage_tokens needs a storage_dir"
        stack = _stack(rank, world_size, False, size=1024, tree_core=tree_core)
    else:
        stack = _l3_stack(
            rank, world_size, False, storage_dir, "wait_complete", tree_core
        )
    rng = random.Random(17)
    gen = torch.Generator().manual_seed(17)
    prefix = random_tokens(rng, device_tokens + host_tokens + storage_tokens)
    if device_tokens:
        stack.cache_prefix(prefix[:device_tokens], gen)
    if storage_tokens:  # a node boundary where the host copy ends
        stack.cache_prefix(prefix[: device_tokens + host_tokens], gen)
    cached = stack.cache_prefix(prefix, gen)
    if storage_dir is not None:
        _settle_storage(stack)  # every page written through to L3
    evicted_device = stack.evict_device(host_tokens + storage_tokens)
    evicted_host = stack.evict_host(storage_tokens) if storage_tokens else 0

    dr = stack.make_request("r0", prefix + random_tokens(rng, 64))
    dr.req.bootstrap_room = 4242
    stack.prealloc.queue.append(dr)
    for _ in range(100):  # admitted at once but for an L3 prefetch
        admitted, failed = stack.admit()
        if admitted or failed:
            break
        stack.cache.check_hicache_events()
        time.sleep(0.02)
    pm = dr.prefix_match
    out = dict(
        evicted_device=evicted_device,
        evicted_host=evicted_host,
        l1=pm.l1_prefix_len,
        l2=pm.l2_host_hit_length,
        l3=pm.l3_storage_hit_length,
        promised=dr.kv_receiver.metadata["decode_prefix_len"],
    )
    for _ in range(200):  # an L3 span lands in host memory first
        out["status"] = _run_restore(stack, dr)
        if out["status"] != "pending":
            break
        stack.cache.check_hicache_events()
        time.sleep(0.01)
    if out["status"] != "ready":
        _finish_or_abort(stack, dr, cached, out)
        return out

    # Prefill's side of the metadata slot (MetadataBuffers.set_buf).
    buffers = MetadataBuffers(
        size=stack.prealloc.req_to_metadata_buffer_idx_allocator.size,
        hidden_size=8,
        hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=0,
    )
    sent = Req(
        rid="r0",
        origin_input_text="",
        origin_input_ids=dr.req.origin_input_ids,
        sampling_params=SamplingParams(temperature=0, max_new_tokens=8),
    )
    sent.metadata_buffer_index = dr.metadata_buffer_index
    sent.output_ids.append(7)
    sent.bootstrap_room = dr.req.bootstrap_room
    sent.cached_tokens = sent.cached_tokens_device = prefill_cached
    buffers.set_buf(sent)
    buffers.bootstrap_room[dr.metadata_buffer_index][0] = dr.req.bootstrap_room

    transfer = stack.transfer
    transfer.metadata_buffers = buffers
    transfer.spec_algorithm = SpeculativeAlgorithm.NONE
    transfer.scheduler.kv_checksum_computer = None
    transfer.scheduler.batch_result_processor = SimpleNamespace(
        _maybe_update_reasoning_tokens=lambda req, token: None
    )
    transfer._commit_transfer_to_req(dr)
    transfer.queue.remove(dr)

    # The waiting queue -> running batch step of _get_new_prebuilt_batch.
    req = dr.req
    req.init_next_round_input(None)
    batch = ScheduleBatch.init_new(
        [req],
        stack.req_to_token_pool,
        stack.allocator,
        stack.cache,
        SimpleNamespace(vocab_size=50000, is_encoder_decoder=False),
        False,
        SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_prebuilt()
    streamer = SimpleNamespace(
        enable_hicache_storage=lambda: bool(storage_dir),
        _get_storage_backend_type=lambda: "file",
    )
    out.update(
        prefix_len=req.prefix_len,
        cached_tokens=req.cached_tokens,
        details=SchedulerOutputStreamer.get_cached_tokens_details(streamer, req),
        sglang=sglang_identity(),
    )
    return out
