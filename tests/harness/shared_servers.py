"""Live servers shared by the test files that need the same one.

Two live test files start servers with the same command line (the drop-in
test's pristine and patched servers, the request fuzz's): each registers its
work on a server named by what starts it, ``(tree, extra_args, model)`` plus
an ``instance`` label when a file needs a server of its own (one a request
kills), at import time::

    KEY = shared_servers.work("upstream", name="fuzz", fn=run_fuzz)

and reads its result in ``setUpClass`` with ``shared_servers.result(KEY,
"fuzz")``. The first ``result`` call starts every registered server at once,
each in a thread (at most ``MAX_STARTING`` starting at a time): the cache is flushed before each work (``/flush_cache``, so
one file's prompts are not another's cache hits, and a barrier: it answers once
every earlier request has finished), each server keeps a ``harness.load_record``
record in ``server.record_dir`` (its forwards and the prefix rows they read, for a
work to compare servers by), the works run in the order
they were registered, the one registered with ``ends_server=True`` last (a
request that kills the server; it may leave no server to stop), then the
server is stopped by PID with its process tree and checked gone. pytest
imports every test module before it runs one, so files run together share a
server; a file run alone starts only its own. A work that raised is re-raised
for its file with the server's log tail; a server that did not start or stop
fails every work registered on it.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import threading

from harness import load_record
from harness.live_server import LiveServer, assert_all_gone, model_path

FLUSH_TIMEOUT_S = 60.0
# Servers starting at once: a start is CPU-bound imports and model loading,
# and the start timeout is per server; the works then run side by side.
MAX_STARTING = 3
_STARTING = threading.BoundedSemaphore(MAX_STARTING)


class _Server:
    def __init__(self, key):
        self.key = key
        self.works: dict = {}  # name -> fn(server)
        self.ending = None  # (name, fn): its last work, which may kill it
        self.results: dict = {}  # name -> value | BaseException


_SERVERS: dict = {}
_LOCK = threading.Lock()
_RAN = False


def key(tree, extra_args=(), model="tiny-llama", instance=""):
    return (tree, tuple(extra_args), model, instance)


def work(
    tree,
    extra_args=(),
    model="tiny-llama",
    *,
    name,
    fn,
    instance="",
    ends_server=False,
):
    """Registers ``fn(server)`` on the server ``key(tree, extra_args, model,
    instance)``; returns that key. ``ends_server``: ``fn`` runs last and its
    request may take the server down."""
    k = key(tree, extra_args, model, instance)
    with _LOCK:
        if _RAN:
            raise RuntimeError(f"work {name!r} registered after the servers ran")
        server = _SERVERS.setdefault(k, _Server(k))
        if name in server.works or (server.ending and server.ending[0] == name):
            raise ValueError(f"work {name!r} registered twice on {k}")
        if ends_server:
            if server.ending is not None:
                raise ValueError(f"{k} already ends with {server.ending[0]!r}")
            server.ending = (name, fn)
        else:
            server.works[name] = fn
    return k


def _run_server(s: _Server) -> None:
    tree, extra_args, model, instance = s.key
    named_model = model if model != "tiny-llama" else ""
    label = "-".join(p for p in ("shared", tree, named_model, instance) if p)
    record_dir = tempfile.mkdtemp(prefix=f"load-record-{label}-")
    try:
        with _STARTING:
            server = LiveServer(
                tree,
                list(extra_args),
                env={load_record.ENV: record_dir},
                name=label,
                model=model,
            )
        server.record_dir = record_dir
    except Exception as exc:  # every work on it fails with the start's error
        shutil.rmtree(record_dir, ignore_errors=True)
        for name in [*s.works, *([s.ending[0]] if s.ending else [])]:
            s.results[name] = exc
        return
    try:
        works = list(s.works.items()) + ([s.ending] if s.ending else [])
        for name, fn in works:
            try:
                server.flush_cache(FLUSH_TIMEOUT_S)
                s.results[name] = fn(server)
            except Exception as exc:  # noqa: BLE001 - re-raised by result()
                s.results[name] = RuntimeError(
                    f"{label}: {name}: {type(exc).__name__}: {exc}\n"
                    f"{server.log_tail()}"
                )
    finally:
        pids = server.stop()
        shutil.rmtree(record_dir, ignore_errors=True)
        try:
            assert_all_gone(pids)
        except AssertionError as exc:
            for name in s.results:
                s.results[name] = exc


def _run_all() -> None:
    global _RAN
    with _LOCK:
        if _RAN:
            return
        _RAN = True
        pending = list(_SERVERS.values())
    for model in dict.fromkeys(s.key[2] for s in pending):
        model_path(model)  # built once here, not by two starting threads
    with concurrent.futures.ThreadPoolExecutor(max(1, len(pending))) as pool:
        for f in [pool.submit(_run_server, s) for s in pending]:
            f.result()


def result(k, name):
    """The value ``name``'s work returned on server ``k`` (every registered
    server runs on the first call); re-raises its failure."""
    _run_all()
    if name not in _SERVERS[k].results:
        raise RuntimeError(f"work {name!r} did not run on {k}")
    value = _SERVERS[k].results[name]
    if isinstance(value, BaseException):
        raise value
    return value
