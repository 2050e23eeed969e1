"""The patched sglang server on a CPU-only machine (``make serve-cpu``).

``python scripts/cpu_server.py [--port P] [-- SERVER_ARGS...]`` builds the tiny
local model (``scripts/tiny_model.py``, cached under ``build/``), then runs
``python -m sglang.launch_server`` of this interpreter's sglang in the
foreground, bound to 127.0.0.1, with the environment and flags that make the
CPU engine work.  SIGINT / SIGTERM stop the server and every process it
started: the launcher gets SIGTERM and drains (sglang refuses new requests
and answers the in-flight ones; its drain loop looks every 5 s), and whatever
is still running ``--stop-grace`` seconds later (default 30) is killed;
nothing is left behind.

``--l3 mooncake`` (``make serve-cpu L3=mooncake``) first starts a real Mooncake
store on 127.0.0.1 (``scripts/mooncake_store.py``: a master and a segment
client that outlives the server), adds HiCache on CPU and the store's flags
(write-through, ``wait_complete`` prefetch) unless SERVER_ARGS set them, and
stops the store with the server.

The live-server tests take ``server_env`` and ``server_args`` from here so
the tests and the documented command start the same server.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import tiny_model

ROOT = Path(__file__).resolve().parent.parent

HOST = "127.0.0.1"
STOP_GRACE_S = 15.0  # servers of the tests (no request in flight at the stop)
SERVE_STOP_GRACE_S = 30.0  # make serve-cpu: in-flight requests are answered
DEFAULT_MAX_TOTAL_TOKENS = 16384

# Flags the CPU engine needs; everything else is the user's (SERVER_ARGS).
CPU_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--skip-server-warmup",
)
# HiCache on CPU: the direct I/O backend with the page_first_direct layout (the
# kernel backend's copy ops exist only on CUDA/ROCm).
HICACHE_ARGS = (
    "--enable-hierarchical-cache",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "page_first_direct",
)


def _int_flag(args: list[str], flags: tuple[str, ...]) -> int:
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                return int(args[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


def dp_size_of(args: list[str]) -> int:
    return _int_flag(args, ("--dp-size", "--dp", "--data-parallel-size"))


def tp_size_of(args: list[str]) -> int:
    return _int_flag(args, ("--tp-size", "--tp", "--tensor-parallel-size"))


def scheduler_ranks(args: list[str]) -> int:
    """Scheduler processes of a launch: TP x DP (DP attention: TP)."""
    tp, dp = tp_size_of(args), dp_size_of(args)
    return tp if "--enable-dp-attention" in args else tp * dp


def omp_bind(dp_size: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND``: this machine's cores split over the
    scheduler ranks (a rank shares a core when there are fewer cores than
    ranks)."""
    cores = sorted(os.sched_getaffinity(0))
    if dp_size <= len(cores):
        per = len(cores) // dp_size
        groups = [cores[i * per : (i + 1) * per] for i in range(dp_size)]
    else:
        groups = [[cores[i % len(cores)]] for i in range(dp_size)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def server_env(extra_args: list[str] | None = None, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(
        SGLANG_USE_CPU_ENGINE="1",  # else RotaryEmbedding falls back to vllm
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        # tests/standins/cpu_server_standins.py: sgl_kernel names, pinned memory,
        # kvcacheio
        SGLANG_TEST_CPU_SERVER_STANDINS="1",
        PYTHONUNBUFFERED="1",
    )
    ranks = scheduler_ranks(list(extra_args or []))
    if ranks > 1:  # startup aborts at TP or DP > 1 without it (numa_utils.py)
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", omp_bind(ranks))
    # The server's console scripts live beside this interpreter.
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def cpu_args(extra: list[str] | None = None) -> list[str]:
    """The CPU engine's flags followed by the user's (no model, host or port)."""
    extra = list(extra or [])
    # A bounded KV pool: the CPU engine otherwise sizes it from free memory
    # (0.95 of it), which a DP>1 launch cannot even determine.
    if not any(a.split("=")[0] == "--max-total-tokens" for a in extra):
        extra = ["--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS)] + extra
    return [*CPU_FLAGS, *extra]


def server_args(model: Path | str, port: int, extra: list[str] | None = None):
    return [
        "--model-path",
        str(model),
        "--host",
        HOST,
        "--port",
        str(port),
        *cpu_args(extra),
    ]


def process_tree(pid: int) -> list[int]:
    import psutil

    try:
        parent = psutil.Process(pid)
        return [pid] + [c.pid for c in parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def stop_tree(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> list[int]:
    """Stop a launched server and every process it started.

    The tree's PIDs are collected first (once the launcher is gone its children
    cannot be found from it), then the launcher gets SIGTERM and shuts its
    children down itself; after ``grace`` seconds whatever of the tree is left
    is killed.  Returns the PIDs that needed SIGKILL.
    """
    import psutil

    tree = []
    for pid in process_tree(proc.pid):
        try:
            tree.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    _, alive = psutil.wait_procs(tree, timeout=grace)
    killed = []
    for p in alive:
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    return killed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--model",
        default="tiny-llama",
        choices=sorted(tiny_model.MODELS),
        help="the tiny local model (built under build/ on first use)",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=SERVE_STOP_GRACE_S,
        help="seconds the server gets to answer in-flight requests after "
        "SIGINT/SIGTERM before what is left is killed",
    )
    parser.add_argument(
        "--l3",
        choices=("none", "mooncake"),
        default="none",
        help="mooncake: start a Mooncake store on 127.0.0.1 and use it as "
        "the HiCache L3 (stopped with the server)",
    )
    parser.add_argument(
        "--l3-segment",
        default="1 GB",
        help="the Mooncake store's memory segment (--l3 mooncake)",
    )
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    extra = [a for a in args.server_args if a != "--"]
    if args.l3 == "mooncake":
        import mooncake_store

        store = mooncake_store.MooncakeStore(segment=args.l3_segment)
        print(f"mooncake store: master {store.master_address}, logs {store.log_dir}")
        try:
            return serve(args, l3_args(extra, store.server_args()) + extra)
        finally:
            print(f"mooncake store stopped: {store.stop()}", flush=True)
    return serve(args, extra)


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def l3_args(extra: list[str], storage: list[str]) -> list[str]:
    """HiCache on CPU plus an L3 backend's flags, each unless ``extra`` sets it."""
    out = [] if _has(extra, "--enable-hierarchical-cache") else list(HICACHE_ARGS)
    defaults = {
        "--hicache-write-policy": "write_through",
        "--hicache-storage-prefetch-policy": "wait_complete",
    }
    for flag, value in defaults.items():
        if not _has(extra, flag):
            out += [flag, value]
    if not _has(extra, "--hicache-storage-backend"):
        out += storage
    return out


def serve(args, extra: list[str]) -> int:
    model = tiny_model.ensure(tiny_model.model_dir(args.model), args.model)
    cmd = [sys.executable, "-m", "sglang.launch_server"]
    cmd += server_args(model, args.port, extra)
    print("+ " + " ".join(cmd), flush=True)
    # Own session, so a signal to our process group reaches us once and we stop
    # the whole server tree in order.
    proc = subprocess.Popen(cmd, env=server_env(extra), start_new_session=True)
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while proc.poll() is None and not stopping:
        time.sleep(0.2)
    if stopping:
        print(
            f"stopping the server (signal {stopping[0]}): in-flight requests "
            f"get {args.stop_grace:g} s",
            flush=True,
        )
        stop_tree(proc, grace=args.stop_grace)
        return 0
    # The server exited on its own: make sure nothing it started lingers.
    stop_tree(proc, grace=2.0)
    rc = proc.returncode or 0
    return 128 - rc if rc < 0 else rc  # killed by a signal: as a shell says it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
