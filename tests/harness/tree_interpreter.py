"""A warm interpreter of another sglang source tree, for ranks run on that tree.

``harness.gloo_ranks.run_ranks`` forks its ranks from a fork server of the
calling process, so they run the sglang that process imports (the installed
patched wheel under pytest).  A scenario compared against another tree (the
pristine release, ``harness.compare``) runs through a ``TreeInterpreter``:
``python -m harness.tree_interpreter`` started once per tree and pytest session
with that tree first on ``PYTHONPATH``; it starts its own fork server (which
imports ``gloo_ranks.PRELOAD`` once, no threads started) and then serves
requests, each a ``run_ranks`` there.

Isolation: the upstream tree and the patched tree never meet in one process
(one interpreter each), and every scenario runs in processes of its own
(forked, so whatever a scenario patches or publishes dies with them).
Per-request environment variables are set in the ranks before the scenario
runs; sglang reads the variables the tests vary (``envs.*``) at use, not at
import.

Protocol: one line ``<spec.pkl> <out.pkl>`` per request on stdin, one line
``done`` on the control channel (the process's original stdout; its fd 1 is
pointed at stderr so stray prints cannot corrupt it).  EOF on stdin ends it.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from harness.gloo_ranks import RankFailure, run_ranks, start_fork_server

TESTS_DIR = Path(__file__).resolve().parent.parent

# Starting includes the fork server's imports (``gloo_ranks.PRELOAD``); on a
# loaded 2-core machine they take several times their idle 20 s.
START_TIMEOUT = 600.0


def resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run_target(rank: int, world_size: int, target: str, *args, **kwargs):
    """One rank of ``target`` (``"module:function"``), imported by the rank."""
    return resolve(target)(rank, world_size, *args, **kwargs)


class TreeInterpreter:
    """Client side: the warm interpreter of one tree (``PYTHONPATH`` entry)."""

    def __init__(self, tree: str):
        self.tree = tree
        self.proc: subprocess.Popen | None = None
        self.log_path: str | None = None

    def _start(self) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix="tree-interpreter-", suffix=".log")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join((self.tree, str(TESTS_DIR)))
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "harness.tree_interpreter"],
                cwd=str(TESTS_DIR),
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self._expect("ready", START_TIMEOUT, "start")

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-chars:]
        except (OSError, TypeError):
            return ""

    def _expect(self, word: str, timeout: float, what: str) -> None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline().strip() if ready else ""
        if line != word:
            tail = self.log_tail()
            self.stop()
            why = f"no answer in {timeout:.0f}s" if not ready else f"got {line!r}"
            raise RuntimeError(
                f"interpreter of tree {self.tree}: {what}: {why}\n{tail}"
            )

    def run(
        self,
        target: str,
        world_size: int,
        args=(),
        kwargs=None,
        *,
        timeout: float,
        env: dict | None = None,
        backend: str = "gloo",
    ):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory() as tmp:
            spec, out = Path(tmp) / "spec.pkl", Path(tmp) / "out.pkl"
            request = (target, world_size, args, kwargs or {}, timeout, env, backend)
            spec.write_bytes(pickle.dumps(request))
            self.proc.stdin.write(f"{spec} {out}\n")
            self.proc.stdin.flush()
            # The server kills ranks at ``timeout``; the margin covers reaping.
            self._expect("done", timeout + 120, target)
            status, payload = pickle.loads(out.read_bytes())
        if status == "ok":
            return payload
        if status == "rank_failure":
            raise RankFailure(payload)
        raise RuntimeError(f"{target}: {payload}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:  # the server and any rank it forked share its session
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


_TREES: dict[str, TreeInterpreter] = {}


def interpreter_for(tree: str) -> TreeInterpreter:
    """The session's warm interpreter of ``tree`` (started at its first run)."""
    if tree not in _TREES:
        _TREES[tree] = TreeInterpreter(tree)
    return _TREES[tree]


@atexit.register
def _stop_all() -> None:
    for tree in _TREES.values():
        tree.stop()
        if tree.log_path:
            Path(tree.log_path).unlink(missing_ok=True)


def _serve() -> None:
    control = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    start_fork_server()
    control.write("ready\n")
    control.flush()
    for line in sys.stdin:
        spec, out = line.split()
        target, world_size, args, kwargs, timeout, env, backend = pickle.loads(
            Path(spec).read_bytes()
        )
        started = time.monotonic()
        try:
            payload = (
                "ok",
                run_ranks(
                    run_target,
                    world_size,
                    target,
                    *args,
                    timeout=timeout,
                    env=env,
                    backend=backend,
                    **kwargs,
                ),
            )
        except RankFailure as exc:
            payload = ("rank_failure", str(exc))
        except BaseException:  # noqa: BLE001 - sent to the client
            payload = ("error", traceback.format_exc())
        print(
            f"tree_interpreter: {target} x{world_size}: {payload[0]} "
            f"in {time.monotonic() - started:.1f}s",
            file=sys.stderr,
        )
        Path(out).write_bytes(pickle.dumps(payload))
        control.write("done\n")
        control.flush()


if __name__ == "__main__":
    _serve()
