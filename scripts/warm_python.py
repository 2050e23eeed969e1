"""A warm interpreter that runs Python scripts in forked children.

``make pr-check`` runs many short interpreters against one layout: an import
check after every patch, every PR test on the pristine release. Each fresh
interpreter spends about half its time importing the same third-party
packages (torch, transformers, ...). ``WarmPython`` imports them once, in a
server process, and forks one child per job: the child gets the job's working
directory, environment, ``sys.path`` (the script's folder, then the job's
``PYTHONPATH``) and ``sys.argv``, runs the script as ``__main__`` with its
output in the job's log, and its exit status is the job's. Jobs of several
threads run side by side (each answer names its job); the caller bounds how
many.

The server never imports sglang unless asked to (``preload`` of a layout that
is not patched afterwards): a job's ``import sglang`` resolves to the job's
``PYTHONPATH`` as in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

# Third-party packages sglang imports at ``import sglang.srt.managers.scheduler``
# that cost the most (about 7 s of 14 s on the CI machine).
THIRD_PARTY = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "transformers",
    "transformers.activations",
    "transformers.modeling_utils",
    "numpy",
    "triton",
    "fastapi",
    "uvicorn",
    "pydantic",
    "zmq",
    "aiohttp",
    "requests",
    "PIL",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    "xgrammar",
    "openai",
    "orjson",
    "msgspec",
    "psutil",
    "jinja2",
    "einops",
    "gguf",
    "compressed_tensors",
    "sympy",
    "scipy",
)

_SERVER = r"""
import importlib, json, os, runpy, select, signal, sys, time
preload, sglang_path = json.loads(sys.argv[1]), sys.argv[2]
if sglang_path:
    sys.path.insert(0, sglang_path)
for name in preload:
    try:
        importlib.import_module(name)
    except Exception:
        pass  # absent here: the job imports it (or fails) as it would
if not sglang_path and any(m.split(".")[0] == "sglang" for m in sys.modules):
    raise SystemExit("a third-party preload imported sglang")
base_path = [p for p in sys.path if p and p != sglang_path]
reply = os.fdopen(int(sys.argv[3]), "w")
print("ready", file=reply, flush=True)


def start(job):
    pid = os.fork()
    if pid:
        return pid
    os.setsid()
    reply.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        os.chdir(job["cwd"])
        # spawned and forkserver children start from (and find the main
        # script in) the directory multiprocessing saw at its import
        import multiprocessing.process
        multiprocessing.process.ORIGINAL_DIR = os.path.abspath(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [job["cwd"]] + extra + base_path
        sys.argv = list(job["argv"])
        if job.get("code") is not None:
            exec(compile(job["code"], "<job>", "exec"), {"__name__": "__main__"})
        else:
            runpy.run_path(job["argv"][0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def finish(pid, job_id, status):
    try:
        os.killpg(pid, signal.SIGKILL)  # the job's whole session
    except ProcessLookupError:
        pass
    if status is None:
        os.waitpid(pid, 0)
    print(json.dumps([job_id, status]), file=reply, flush=True)


# Jobs run side by side: each line starts one, each ending answers its id.
running, pending, open_ = {}, b"", True  # pid -> (job id, deadline)
while open_ or running:
    if open_ and select.select([0], [], [], 0.05)[0]:
        chunk = os.read(0, 1 << 16)
        open_ = bool(chunk)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = json.loads(line)
            running[start(job)] = (job["id"], time.monotonic() + job["timeout"])
    elif not open_:
        time.sleep(0.05)
    for pid, (job_id, deadline) in list(running.items()):
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            finish(pid, job_id, os.waitstatus_to_exitcode(raw))
        elif time.monotonic() > deadline:
            finish(pid, job_id, None)
        else:
            continue
        del running[pid]
"""


class WarmPython:
    """``with WarmPython(preload) as warm: warm.run(...)``; see the module
    docstring. ``sglang_path``: a layout's ``python/`` the preload may import
    sglang from (only for a layout that stays unchanged while it runs)."""

    def __init__(self, preload=THIRD_PARTY, sglang_path: Path | None = None):
        self.preload, self.sglang_path = list(preload), sglang_path

    def __enter__(self) -> "WarmPython":
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SERVER,
                json.dumps(self.preload),
                str(self.sglang_path or ""),
                str(write),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(write,),
            text=True,
            start_new_session=True,
        )
        os.close(write)
        self.reply = os.fdopen(read)
        if self.reply.readline().strip() != "ready":
            code = self.proc.wait()
            raise RuntimeError(f"the warm interpreter did not start (exit {code})")
        self.lock, self.next_id = threading.Lock(), 0
        self.waiting: dict = {}  # job id -> Event
        self.results: dict = {}  # job id -> exit status | None
        self.reader = threading.Thread(target=self._answers, daemon=True)
        self.reader.start()
        return self

    def run(
        self,
        argv: list[str],
        cwd: Path,
        env: dict,
        log: Path,
        timeout: float,
        code: str | None = None,
    ) -> int | None:
        """Run ``argv[0]`` (or ``code`` with ``argv``) in a forked child;
        its exit status, or None when it ran past ``timeout`` (killed with its
        session). Threads may call it at once: their jobs run side by side."""
        with self.lock:
            self.next_id += 1
            job_id, done = self.next_id, threading.Event()
            self.waiting[job_id] = done
            job = {
                "id": job_id,
                "argv": [str(a) for a in argv],
                "cwd": str(cwd),
                "env": env,
                "log": str(log),
                "timeout": timeout,
                "code": code,
            }
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        done.wait()
        with self.lock:
            del self.waiting[job_id]
            if job_id not in self.results:
                raise RuntimeError(f"the warm interpreter exited ({self.proc.wait()})")
            return self.results.pop(job_id)

    def _answers(self) -> None:
        """Hands each answer line (``[id, status]``) to the job waiting on it;
        at the server's end, wakes every job still waiting."""
        for line in self.reply:
            job_id, status = json.loads(line)
            with self.lock:
                self.results[job_id] = status
                self.waiting[job_id].set()
        with self.lock:
            for done in self.waiting.values():
                done.set()

    def __exit__(self, *exc) -> None:
        try:
            self.proc.stdin.close()
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.reader.join(timeout=10)  # the server's end: its answers end
            self.reply.close()
