"""Run one function per rank in N real processes joined into a gloo group.

``run_ranks(fn, world_size, *args, timeout=..., env=...)`` calls
``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes of the
patched tree and returns the per-rank results in rank order.  The processes
are forked from the tree's warm interpreter (``harness.warm_tree``), so each
rank is a process of its own with sglang already imported.  A rank that raises
fails the run with its traceback and the tail of its output; ranks still
running at the timeout, or whose peer failed (they may block in a collective
forever), are killed and the error names them.  ``fn`` must be a module-level
function of an importable module.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback


class RankFailure(RuntimeError):
    pass


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_child(fn, rank, world_size, args, kwargs, env, backend, tmp) -> int:
    """The body of a forked rank; returns its exit code."""
    log = os.open(f"{tmp}/rank{rank}.log", os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    _die_with_parent()
    atexit._clear()  # only what the scenario registers runs at its end
    ok = False
    try:
        os.environ.update(env or {})
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world_size,
        )
        payload = ("ok", fn(rank, world_size, *args, **kwargs))
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        ok = True
    except BaseException:
        payload = ("error", traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except BaseException:
        ok, data = False, pickle.dumps(("error", traceback.format_exc()))
    with open(f"{tmp}/rank{rank}.tmp", "wb") as f:
        f.write(data)
    os.rename(f"{tmp}/rank{rank}.tmp", f"{tmp}/rank{rank}.pkl")
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0 if ok else 1


def _log_tail(tmp: str, rank: int, chars: int = 3000) -> str:
    try:
        with open(f"{tmp}/rank{rank}.log", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def fork_ranks(
    fn,
    world_size: int,
    args=(),
    kwargs=None,
    *,
    timeout: float,
    env: dict | None = None,
    backend: str = "gloo",
):
    """Fork ``world_size`` ranks of this process and run ``fn`` in each (the
    warm interpreter's side of ``run_ranks``)."""
    kwargs = kwargs or {}
    with tempfile.TemporaryDirectory() as tmp:
        sys.stdout.flush()
        sys.stderr.flush()
        pids: dict[int, int] = {}
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _rank_child(
                        fn, rank, world_size, args, kwargs, env, backend, tmp
                    )
                finally:
                    os._exit(code)
            pids[pid] = rank
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        while pids and not errors and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.02)
                continue
            rank = pids.pop(pid)
            try:
                with open(f"{tmp}/rank{rank}.pkl", "rb") as f:
                    kind, payload = pickle.load(f)
            except OSError:
                kind, payload = "error", f"process exited with status {status}"
            if kind == "ok":
                out[rank] = payload
            else:
                errors[rank] = f"{payload}\n--- rank {rank} output ---\n" + _log_tail(
                    tmp, rank
                )
        stragglers = sorted(pids.values())
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)
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


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 480.0,
    backend: str = "gloo",
    env: dict | None = None,
    **kwargs,
):
    from harness.compare import patched_tree
    from harness.warm_tree import target_of, warm_tree

    return warm_tree(patched_tree()).run(
        target_of(fn),
        world_size,
        args,
        kwargs,
        timeout=timeout,
        env=env,
        backend=backend,
    )
