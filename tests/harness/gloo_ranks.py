"""Run one function per rank in N real processes joined into a gloo group.

``run_ranks(fn, world_size, *args, timeout=..., env=..., **kwargs)`` calls
``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes and
returns the per-rank results in rank order. A rank that raises fails the run
with its traceback and the tail of its output; ranks still running at the
timeout, or whose peer failed (they may block in a collective forever), are
killed and the error names them. ``fn`` must be a module-level function.

A run whose failed ranks all failed a check of the test (an
``AssertionError`` in the rank, raised outside sglang's own code: an assert
of sglang failing is an error) raises ``RankAssertionError``, a
``RankFailure`` that is also an ``AssertionError``: the test id fails by its
own assertion, as if it were made in the test. Any other exception of a rank,
a rank that dies without a result, or a timeout raises a plain
``RankFailure`` (an error of the test, not its failure).

The ranks are forked by multiprocessing's fork server, which imports
``PRELOAD`` (sglang's scheduler stack) once per process that runs ranks, so a
run costs its own work rather than an import of sglang per rank; each rank is
still a process of its own, started from that clean image (never from the
calling process).
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

UPSTREAM_TEST_MODULE = "sglang.test.gloo_ranks"

# Imported once by the fork server, never by ranks; a module missing from a
# tree is skipped and fails in the scenario needing it.
PRELOAD = (
    "torch",
    "torch.distributed",
    "sglang.srt.server_args",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.data_parallel_controller",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.dsa",
)


class RankFailure(RuntimeError):
    """``results``: the results of the ranks that finished (rank -> result),
    a failed run's ranks included."""

    def __init__(self, message: str, results: dict | None = None):
        super().__init__(message)
        self.results = dict(results or {})


class RankAssertionError(RankFailure, AssertionError):
    """Every failed rank raised an ``AssertionError``: the test's own check
    failed in a rank."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def raised_in_product(exc: BaseException) -> bool:
    """``exc`` was raised in sglang's own code: its innermost frame is in the
    imported sglang package but not in ``sglang.test`` (where an upstream PR
    carries this harness)."""
    package = sys.modules.get("sglang")
    frames = traceback.extract_tb(exc.__traceback__)
    if package is None or not getattr(package, "__file__", None) or not frames:
        return False
    root = os.path.dirname(os.path.realpath(package.__file__))
    path = os.path.realpath(frames[-1].filename)
    inside = path.startswith(root + os.sep)
    return inside and not path.startswith(os.path.join(root, "test") + os.sep)


def rank_body(fn, rank, world_size, args, kwargs, env, backend, tmp) -> int:
    """One rank: output to ``tmp/rank<r>.log``, joins the group, runs ``fn``,
    leaves ``("ok", result)`` or ``("error", traceback)`` in
    ``tmp/rank<r>.pkl``; returns its exit code."""
    log = os.open(f"{tmp}/rank{rank}.log", os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    _die_with_parent()
    atexit._clear()  # only what the scenario registers runs at its end
    ok = joined = False
    try:
        os.environ.update(env or {})
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world_size,
        )
        joined = True
        payload = ("ok", fn(rank, world_size, *args, **kwargs))
        ok = True
    except AssertionError as e:
        # the scenario's check; an assert of sglang's own code is an error
        kind = "error" if raised_in_product(e) else "assertion"
        payload = (kind, traceback.format_exc())
    except BaseException:
        payload = ("error", traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except BaseException:
        ok, data = False, pickle.dumps(("error", traceback.format_exc()))
    # The result is on disk before the group is left: a peer failing once
    # this rank leaves cannot lose it (collect reads it from a killed rank).
    with open(f"{tmp}/rank{rank}.tmp", "wb") as f:
        f.write(data)
    os.rename(f"{tmp}/rank{rank}.tmp", f"{tmp}/rank{rank}.pkl")
    if ok and joined:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
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


def collect(tmp: str, world_size: int, timeout: float, reap, kill) -> list:
    """The ranks' results in rank order. ``reap()`` returns the (rank, exit
    status) of ranks that ended since its last call, without blocking;
    ``kill()`` kills and reaps the ranks still running and returns them."""
    out, errors, assertions = {}, {}, set()
    deadline = time.monotonic() + timeout
    while len(out) + len(errors) < world_size and not errors:
        if time.monotonic() > deadline:
            break
        ended = reap()
        if not ended:
            time.sleep(0.02)
        for rank, status in ended:
            try:
                with open(f"{tmp}/rank{rank}.pkl", "rb") as f:
                    kind, payload = pickle.load(f)
            except OSError:
                kind, payload = "error", f"process exited with status {status}"
            if kind == "ok":
                out[rank] = payload
            else:
                if kind == "assertion":
                    assertions.add(rank)
                errors[rank] = f"{payload}\n--- rank {rank} output ---\n" + _log_tail(
                    tmp, rank
                )
    stragglers = sorted(kill())
    for rank in stragglers:  # a result written before the rank was killed
        try:
            with open(f"{tmp}/rank{rank}.pkl", "rb") as f:
                kind, payload = pickle.load(f)
        except OSError:
            continue
        if kind == "ok":
            out[rank] = payload
    if errors:
        first = min(errors)
        failure = RankAssertionError if assertions == set(errors) else RankFailure
        raise failure(
            f"rank {first} failed (of {world_size}; failed ranks {sorted(errors)}, "
            f"killed {stragglers}):\n{errors[first]}",
            out,
        )
    if len(out) < world_size:
        missing = [r for r in range(world_size) if r not in out]
        raise RankFailure(
            f"timeout after {timeout:.0f}s: ranks {missing} did not finish "
            f"(killed {stragglers})",
            out,
        )
    return [out[r] for r in range(world_size)]


def _started(*args) -> None:
    # As a forked rank: no interpreter shutdown (a scenario may leave
    # non-daemon threads running once its result is written).
    os._exit(rank_body(*args))


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # used when the server starts
    return ctx


def start_fork_server() -> None:
    """Start the fork server and wait until it has imported ``PRELOAD`` (a
    process that serves many runs pays the import up front, not in its first
    run)."""
    proc = _context().Process(target=os.getpid)
    proc.start()
    proc.join()


def start_ranks(fn, world_size, args=(), kwargs=None, *, timeout, env, backend):
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        procs = {
            rank: ctx.Process(
                target=_started,
                args=(fn, rank, world_size, args, kwargs or {}, env, backend, tmp),
            )
            for rank in range(world_size)
        }
        for proc in procs.values():
            proc.start()
        running = dict(procs)

        def reap():
            ended = [
                (r, p.exitcode) for r, p in running.items() if p.exitcode is not None
            ]
            for rank, _ in ended:
                running.pop(rank).join()
            return ended

        def kill():
            for proc in running.values():
                proc.kill()
                proc.join()
            return list(running)

        return collect(tmp, world_size, timeout, reap, kill)


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 480.0,
    backend: str = "gloo",
    env: dict | None = None,
    **kwargs,
):
    if "<locals>" in fn.__qualname__:
        raise ValueError(f"{fn.__qualname__} must be a module-level function")
    return start_ranks(
        fn, world_size, args, kwargs, timeout=timeout, env=env, backend=backend
    )
