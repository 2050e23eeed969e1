"""Spawn N real processes in a gloo group and run one function per rank.

``run_ranks(fn, world_size, *args, timeout=...)`` starts ``world_size`` fresh
interpreters (``spawn``), joins them into a ``torch.distributed`` gloo group
(file rendezvous), calls ``fn(rank, world_size, *args)`` in each and returns the
per-rank results in rank order.  A rank that raises fails the run with its
traceback; ranks still running at the timeout are killed (stragglers never
outlive the test) and the error names them.  ``fn`` must be importable by
module path (a module-level function).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent


class RankFailure(RuntimeError):
    pass


def _entry(fn, rank, world_size, init_file, args, kwargs, results, backend):
    try:
        if str(TESTS_DIR) not in sys.path:
            sys.path.insert(0, str(TESTS_DIR))
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
        )
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", pickle.dumps(out)))
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 480.0,
    backend: str = "gloo",
    env: dict | None = None,
    **kwargs,
):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        saved = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            procs = [
                ctx.Process(
                    target=_entry,
                    args=(fn, r, world_size, init_file, args, kwargs, results, backend),
                    daemon=True,
                )
                for r in range(world_size)
            ]
            for p in procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(errors) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if not p.is_alive()
                        and p.exitcode not in (0, None)
                        and r not in out
                        and r not in errors
                    ]
                    for r in dead:
                        errors[r] = f"process exited with code {procs[r].exitcode}"
                    continue
                if status == "ok":
                    out[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
                if errors:
                    # One rank failed: its peers may block in a collective forever.
                    break
        finally:
            for p in procs:
                p.join(timeout=0.5 if errors or len(out) < world_size else 10)
            stragglers = [r for r, p in enumerate(procs) if p.is_alive()]
            for r in stragglers:
                procs[r].kill()
            for p in procs:
                p.join(timeout=5)
        if errors:
            first = min(errors)
            raise RankFailure(
                f"rank {first} failed (of {world_size}; failed ranks {sorted(errors)}, "
                f"killed {stragglers}):\n{errors[first]}"
            )
        if len(out) < world_size:
            missing = [r for r in range(world_size) if r not in out]
            raise RankFailure(
                f"timeout after {timeout:.0f}s: ranks {missing} did not finish "
                f"(killed {stragglers})"
            )
        return [out[r] for r in range(world_size)]
