"""This project's rank runner: ranks forked from a warm interpreter.

``run_ranks`` has the contract of ``harness.gloo_ranks.run_ranks`` (pytest
routes that one here, tests/conftest.py); the ranks are forked from the
patched tree's warm interpreter (``harness.warm_tree``), so each rank is a
process of its own with sglang already imported. ``fork_ranks`` is the warm
interpreter's side.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile

from harness.gloo_ranks import RankFailure, collect, rank_body

__all__ = ["RankFailure", "fork_ranks", "run_ranks"]


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
                    code = rank_body(
                        fn, rank, world_size, args, kwargs, env, backend, tmp
                    )
                finally:
                    os._exit(code)
            pids[pid] = rank

        def reap():
            ended = []
            while pids:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                ended.append((pids.pop(pid), status))
            return ended

        def kill():
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            for pid in pids:
                os.waitpid(pid, 0)
            return list(pids.values())

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
