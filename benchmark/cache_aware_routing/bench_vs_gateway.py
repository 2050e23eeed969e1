"""In-engine DP routing side by side with the gateway users run: SMG.

SMG (the SGLang Model Gateway, ``smg`` on PyPI, pinned in
``requirements-gateway.txt``; ``make gateway-venv`` installs it into
``build/gateway-venv``, never into the test venv) is started by this
benchmark on 127.0.0.1 in front of a live DP=2 server of the installed wheel
(CPU, tiny llama; ``harness.live_server.LiveServer``), and stopped by PID
with its process group.  Policies, each on its own server starts:

* ``round_robin`` and ``cache_aware_c256`` / ``cache_aware_c64``: the
  server's ``--load-balance-method`` (ours with ``--dp-routing-digest-chunk-size``
  256 and 64), requests sent to the server;
* ``smg_dp_aware``: ``smg launch --policy cache_aware --dp-aware`` over a
  ``round_robin`` server: SMG registers one worker per DP rank
  (``URL@rank``) and sends every request with its ``data_parallel_rank``,
  which the server honours before its own method;
* ``smg_two_level``: ``smg launch --policy cache_aware`` (no
  ``--dp-aware``) over a ``cache_aware`` server (chunk 64): SMG picks the
  instance (here the only one), the engine picks the DP rank;
* ``smg_dp_aware_x2`` / ``smg_dp_aware_x2_mesh`` / ``smg_two_level_x2``: the
  same with two SMG replicas, as an HA deployment runs them, and the client
  sending its requests to them in turn, request by request (an L4 balancer
  without session affinity).  ``_mesh``: the replicas form SMG's HA mesh
  (``--enable-mesh`` on 127.0.0.1, the second joining the first), which
  gossips the cache-aware trees; without it each replica's tree sees only
  the requests it routed.

SMG runs with its defaults (``--cache-threshold 0.3``, balance thresholds 64 /
1.5, its warm-up divert): what a user gets.  SMG's KV-event mode needs gRPC
workers and is not run here: docs/benchmarks.md says why.

Workloads (``harness.live_workloads``; every request a streamed greedy
``/generate`` of ``input_ids``, which SMG routes by the ids' text):

* ``chat``: 8 conversations x 4 turns, 300-id first prompts, 60 new ids a
  turn, 4 clients;
* ``short_chat``: the same with 60-id first prompts and 30 new ids: every
  prompt stays under 256 tokens;
* ``sysprompt_short`` / ``sysprompt_long``: 12 conversations x 2 turns over 3
  shared system prompts of 100 / 600 ids, each with a 40-id question;
* ``burst``: 4 bursts of 6 requests sharing a new 400-id system prompt,
  sent 30 ms apart;
* ``grpo_group``: 4 RL rollout groups of 8 identical 400-id prompts at once;
  ``grpo_n``: 4 requests with ``n = 8``;
* ``host_tier``: 12 conversations x 4 turns on servers with
  ``--max-total-tokens 1536`` and HiCache (ratio 4): the working set exceeds
  a rank's device pool and revisits are served from the host tier;
* ``evict``: the same on servers with the small pool and no HiCache: ranks
  evict under pressure.

The default group's servers run ``--disable-overlap-schedule`` (with the
overlap scheduler no request of a burst or rollout group can reuse
another's prefill on any rank; ``bench_live_routing.py`` measures both).
Each workload runs ``--reps`` times (new prompts each time) on the same
server.  Reported per workload and policy: hit rate (cached / prompt
tokens, median over the reps with min-max), prefill tokens computed (summed
over the reps), host share of the cached tokens, requests per DP rank,
client TTFT p50 / p90 pooled over every request of the reps.  Ratios are
against ``round_robin`` of the same run.

Writes ``results/<stamp>-vs-gateway/``: ``summary.json`` (``{"smg_version",
"series_label", "workloads": {workload: {policy: {"hit_rate",
"ttft_p90_s", "reps", ...}}}}``), ``bench_vs_gateway.json`` (metadata and
every record) and ``bench_vs_gateway.png``.

Run: ``make gateway-venv`` once, then ``.venv/bin/python -m
benchmark.cache_aware_routing.bench_vs_gateway [--quick] [--reps N]
[--policies ...] [--workloads ...]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from benchmark.bench_meta import run_dir, run_metadata, series_label
from benchmark.cache_aware_routing.bench_live_routing import (
    aggregate,
    fmt_or_dash,
    log_errors,
    summarize,
)
from harness.live_server import HICACHE_ARGS, LiveServer, assert_all_gone, free_port
from harness.live_workloads import (
    run_bursts,
    run_conversations,
    run_n,
    shared_system_conversations,
)
from harness.metrics import routing_outcomes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SMG_BIN = ROOT / "build" / "gateway-venv" / "bin" / "smg"
REQUIREMENTS = HERE / "requirements-gateway.txt"
DP = 2

# policy -> (server --load-balance-method + args, SMG args or None)
POLICIES = {
    "round_robin": (["--load-balance-method", "round_robin"], None),
    "cache_aware_c256": (
        ["--load-balance-method", "cache_aware"]
        + ["--dp-routing-digest-chunk-size", "256"],
        None,
    ),
    "cache_aware_c64": (
        ["--load-balance-method", "cache_aware"]
        + ["--dp-routing-digest-chunk-size", "64"],
        None,
    ),
    "smg_dp_aware": (
        ["--load-balance-method", "round_robin"],
        ["--policy", "cache_aware", "--dp-aware"],
    ),
    "smg_two_level": (
        ["--load-balance-method", "cache_aware"]
        + ["--dp-routing-digest-chunk-size", "64"],
        ["--policy", "cache_aware"],
    ),
}
SMALL_POOL = ["--max-total-tokens", "1536"]
# server group -> (extra server args, workloads served on one start)
GROUPS = {
    "default": (
        ["--disable-overlap-schedule"],
        [
            "chat",
            "short_chat",
            "sysprompt_short",
            "sysprompt_long",
            "burst",
            "grpo_group",
            "grpo_n",
        ],
    ),
    "host_tier": (SMALL_POOL + HICACHE_ARGS + ["--hicache-ratio", "4"], ["host_tier"]),
    "evict": (SMALL_POOL, ["evict"]),
}
WORKLOADS = [w for _, ws in GROUPS.values() for w in ws]
CHAT = dict(n=8, turns=4, first=300, new_tokens=60, clients=4)
SHORT_CHAT = dict(n=8, turns=5, first=60, new_tokens=30, clients=4)
SYSPROMPT = dict(n=12, turns=2, systems=3, question_tokens=40, new_tokens=40)
SYSTEM_TOKENS = {"sysprompt_short": 100, "sysprompt_long": 600}
POOL_CHAT = dict(n=12, turns=4, first=300, new_tokens=60, clients=4)
BURST = dict(bursts=4, size=6, prompt_tokens=400, question_tokens=30, stagger_s=0.03)
GRPO = dict(bursts=4, size=8, prompt_tokens=400, question_tokens=0, stagger_s=0.0)
GRPO_N = dict(groups=4, n=8, prompt_tokens=400)
THINK_S = 0.5
MAX_NEW_TOKENS = 8
SEED_OFFSET = {w: 1000 * i for i, w in enumerate(WORKLOADS)}
# policy -> (SMG replicas, HA mesh); a policy not named here has one SMG
REPLICAS = {
    "smg_dp_aware_x2": (2, False),
    "smg_dp_aware_x2_mesh": (2, True),
    "smg_two_level_x2": (2, False),
}
POLICIES["smg_dp_aware_x2"] = POLICIES["smg_dp_aware"]
POLICIES["smg_dp_aware_x2_mesh"] = POLICIES["smg_dp_aware"]
POLICIES["smg_two_level_x2"] = POLICIES["smg_two_level"]
MESH_TIMEOUT_S = 60.0


class Gateway:
    """``smg launch`` on 127.0.0.1 in front of ``worker_url``, in its own
    process group; ``base_url`` is what clients send to.  Ready when
    ``/readiness`` reports every expected worker healthy."""

    def __init__(
        self,
        smg_bin: Path,
        worker_url: str,
        args: list[str],
        workers: int,
        mesh: list[str] = (),
    ):
        if not smg_bin.is_file():
            raise SystemExit(
                f"no SMG at {smg_bin}: run `make gateway-venv` (installs "
                f"{REQUIREMENTS.relative_to(ROOT)} into build/gateway-venv) "
                "or pass --smg-bin"
            )
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.logdir = Path(tempfile.mkdtemp(prefix="smg-"))
        self.log_path = self.logdir / "smg.log"
        self._log = open(self.log_path, "w")
        command = [str(smg_bin), "launch", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--worker-urls", worker_url]
        metrics_port = free_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        command += ["--prometheus-host", "127.0.0.1"]
        command += ["--prometheus-port", str(metrics_port)]
        command += [*args, *mesh]
        self.command = command
        env = {**os.environ, "NO_COLOR": "1"}
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            self._wait_ready(workers, timeout=120.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, workers: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"smg exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                r = requests.get(f"{self.base_url}/readiness", timeout=5)
                last = r.text
                if r.ok and r.json().get("healthy_workers") == workers:
                    return
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"smg not ready within {timeout:.0f} s: {last}")

    def workers(self) -> list[str]:
        r = requests.get(f"{self.base_url}/workers", timeout=10)
        return sorted(w["url"] for w in r.json()["workers"])

    def mesh_peers(self) -> set[str]:
        """The mesh peers this replica has exchanged state with: those named
        by a nonzero ``router_mesh_*`` sample of its metrics (the dialling
        side reports ``router_mesh_peer_connections``, the dialled side
        ``router_mesh_sync_round_duration_seconds_count``)."""
        text = requests.get(self.metrics_url, timeout=5).text
        peers = set()
        for line in text.splitlines():
            if not line.startswith("router_mesh_") or 'peer="' not in line:
                continue
            if float(line.rsplit(" ", 1)[1]) > 0:
                peers.add(line.split('peer="', 1)[1].split('"', 1)[0])
        return peers - {""}

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> list[int]:
        pids = [self.proc.pid]
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self._log.close()
        return pids


class Replicas:
    """The client's side of several gateway replicas: every read of
    ``base_url`` (one per request in ``harness.live_workloads``) is the next
    replica's, in turn."""

    def __init__(self, gateways):
        self.urls = [g.base_url for g in gateways]
        self._next = itertools.cycle(self.urls)
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        with self._lock:
            return next(self._next)


def start_gateways(smg_bin, worker_url, args, workers, replicas, mesh):
    """``replicas`` SMG processes in front of ``worker_url``; with ``mesh``
    they form SMG's HA mesh on 127.0.0.1 (each after the first joins the
    first) and are returned once every replica is connected to every other."""
    gateways = []
    try:
        mesh_addrs = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        for i in range(replicas):
            extra = []
            if mesh:
                extra = ["--enable-mesh", "--mesh-host", "127.0.0.1"]
                extra += ["--mesh-port", mesh_addrs[i].split(":")[1]]
                extra += ["--mesh-server-name", f"smg{i}"]
                if i:
                    extra += ["--mesh-peer-urls", mesh_addrs[0]]
            gateways.append(Gateway(smg_bin, worker_url, args, workers, extra))
        if mesh:
            names = {f"smg{i}" for i in range(replicas)}
            deadline = time.monotonic() + MESH_TIMEOUT_S
            while True:
                missing = {
                    f"smg{i}": (names - {f"smg{i}"}) - g.mesh_peers()
                    for i, g in enumerate(gateways)
                }
                if not any(missing.values()):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"SMG mesh not joined within {MESH_TIMEOUT_S:.0f} s: "
                        f"missing peers {missing}"
                    )
                time.sleep(0.5)
    except BaseException:
        for gw in gateways:
            gw.stop()
        raise
    return gateways


def run_workload(target, workload: str, seed: int):
    common = dict(stream=True, max_new_tokens=MAX_NEW_TOKENS, think_s=THINK_S)
    if workload in ("chat", "short_chat", "host_tier", "evict"):
        work = {"chat": CHAT, "short_chat": SHORT_CHAT}.get(workload, POOL_CHAT)
        return run_conversations(target, seed=seed, **work, **common)
    if workload in SYSTEM_TOKENS:
        w = SYSPROMPT
        first = shared_system_conversations(
            w["n"], seed, w["systems"], SYSTEM_TOKENS[workload], w["question_tokens"]
        )
        return run_conversations(
            target,
            n=w["n"],
            turns=w["turns"],
            seed=seed,
            new_tokens=w["new_tokens"],
            clients=4,
            first_prompts=first,
            **common,
        )
    if workload in ("burst", "grpo_group"):
        return run_bursts(
            target, seed=seed, **(BURST if workload == "burst" else GRPO), **common
        )
    if workload == "grpo_n":
        return run_n(
            target,
            seed=seed,
            think_s=THINK_S,
            max_new_tokens=MAX_NEW_TOKENS,
            **GRPO_N,
        )
    raise ValueError(workload)


def serve_group(policy, group, workloads, reps, seed, smg_bin):
    server_args, smg_args = POLICIES[policy]
    extra, _ = GROUPS[group]
    args = ["--dp-size", str(DP), "--enable-metrics", *server_args, *extra]
    name = f"{policy}-{group}"
    print(f"[{name}] starting: {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    server = LiveServer("patched", args, name=name)
    gateways = []
    info = {
        "policy": policy,
        "group": group,
        "server_args": args,
        "sglang": importlib.metadata.version("sglang"),
    }
    runs = {}
    try:
        if smg_args is not None:
            workers = DP if "--dp-aware" in smg_args else 1
            replicas, mesh = REPLICAS.get(policy, (1, False))
            gateways = start_gateways(
                smg_bin, server.base_url, smg_args, workers, replicas, mesh
            )
            # without the binary's path
            info["smg_commands"] = [g.command[1:] for g in gateways]
            info["smg_workers"] = [
                w.replace(server.base_url, "SERVER") for w in gateways[0].workers()
            ]
        info["start_s"] = time.perf_counter() - t0
        print(f"[{name}] up in {info['start_s']:.0f} s", flush=True)
        # the workloads send to target.base_url: the gateways' in turn, else
        # the server's
        target = Replicas(gateways) if gateways else server
        for workload in workloads:
            reps_out = []
            for r in range(reps):
                t1 = time.perf_counter()
                try:
                    records = run_workload(
                        target, workload, seed + SEED_OFFSET[workload] + 100 * r
                    )
                except Exception as exc:
                    tail = "\n".join(g.log_tail() for g in gateways)
                    raise RuntimeError(
                        f"{name}/{workload}: {exc}\n{server.log_tail()}\n{tail}"
                    ) from exc
                summary = summarize(records, DP)
                summary["wall_s"] = time.perf_counter() - t1
                reps_out.append({"summary": summary, "records": records})
                print(
                    f"[{name}] {workload} rep {r}: {summary['wall_s']:.0f} s, "
                    f"hit rate {summary['hit_rate']:.3f}, split "
                    f"{summary['requests_per_rank']}",
                    flush=True,
                )
            runs[workload] = {"summary": aggregate(reps_out), "reps": reps_out}
        info["routing_outcomes"] = routing_outcomes(server)
    finally:
        pids = []
        for gateway in gateways:
            pids += gateway.stop()
        pids += server.stop()
        info["log_errors"] = log_errors(server)
    assert_all_gone(pids)
    return runs, info


def prefill_tokens(run) -> int:
    return sum(
        r["prompt"] - r["cached"]
        for x in run["reps"]
        for conv in x["records"]
        for r in conv
    )


def smg_version(smg_bin: Path) -> str:
    out = subprocess.run(
        [str(smg_bin), "--version"], capture_output=True, text=True, check=True
    ).stdout
    return out.split()[-1] if out.split() else "unknown"


def build_summary(runs, smg_ver, label):
    """The committed summary: per workload and policy the headline figures."""
    workloads = {}
    for (policy, workload), run in runs.items():
        s = run["summary"]
        workloads.setdefault(workload, {})[policy] = {
            "hit_rate": s["hit_rate"],
            "hit_rate_min": s["hit_rate_min"],
            "hit_rate_max": s["hit_rate_max"],
            "prefill_tokens": prefill_tokens(run),
            "host_share": s["host_share"],
            "requests_per_rank": s["requests_per_rank"],
            "ttft_p50_s": s["ttft_p50_pooled_s"],
            "ttft_p90_s": s["ttft_p90_pooled_s"],
            "reps": s["reps"],
        }
    for rows in workloads.values():
        rr = rows.get("round_robin")
        for row in rows.values():
            for key in ("hit_rate", "prefill_tokens", "ttft_p90_s"):
                row[key + "_vs_rr"] = row[key] / rr[key] if rr and rr[key] else None
    return {"smg_version": smg_ver, "series_label": label, "workloads": workloads}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one rep, smoke run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--smg-bin", type=Path, default=SMG_BIN)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    args = ap.parse_args()
    reps = 1 if args.quick else args.reps
    smg_ver = smg_version(args.smg_bin)
    label = series_label()
    meta_start = run_metadata()  # the tree as it served, not as it is at the end
    t0 = time.perf_counter()
    runs, servers = {}, []
    for policy in args.policies:
        for group, (_, workloads) in GROUPS.items():
            workloads = [w for w in workloads if w in args.workloads]
            if not workloads:
                continue
            try:
                group_runs, info = serve_group(
                    policy, group, workloads, reps, args.seed, args.smg_bin
                )
            except Exception as exc:  # keep the other groups' results
                print(f"[{policy}-{group}] FAILED: {exc}", flush=True)
                group_runs, info = {}, {
                    "policy": policy,
                    "group": group,
                    "error": str(exc)[-6000:],
                }
            for workload, run in group_runs.items():
                runs[(policy, workload)] = run
            servers.append(info)
    summary = build_summary(runs, smg_ver, label)
    summary["git_revision"] = meta_start["git_revision"]
    _print(summary, servers)
    folder = run_dir(args.out, "vs-gateway" + ("-quick" if args.quick else ""))
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    meta = {
        **meta_start,
        "series": importlib.metadata.version("sglang"),
        "smg_version": smg_ver,
        "params": {
            "dp_size": DP,
            "reps": reps,
            "seed": args.seed,
            "policies": {p: POLICIES[p] for p in args.policies},
            "smg_replicas": {p: REPLICAS.get(p, (1, False)) for p in args.policies},
            "groups": {g: GROUPS[g] for g in GROUPS},
            "chat": CHAT,
            "short_chat": SHORT_CHAT,
            "sysprompt": {**SYSPROMPT, "system_tokens": SYSTEM_TOKENS},
            "pool_chat": POOL_CHAT,
            "burst": BURST,
            "grpo_group": GRPO,
            "grpo_n": GRPO_N,
            "think_s": THINK_S,
            "max_new_tokens": MAX_NEW_TOKENS,
            "ttft": "client-measured, request sent to first SSE data chunk",
        },
        "wall_s": time.perf_counter() - t0,
        "servers": servers,
        "runs": [{"policy": p, "workload": w, **run} for (p, w), run in runs.items()],
    }
    path = folder / "bench_vs_gateway.json"
    path.write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    _plot(summary, args.policies, path.with_suffix(".png"))
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    print(f"\nwrote {shown}/summary.json, bench_vs_gateway.json and .png")
    failed = [f"{s['policy']}-{s['group']}" for s in servers if "error" in s]
    if failed:
        sys.exit(f"failed server groups: {', '.join(failed)}")


def _print(summary, servers):
    print(
        f"\nDP={DP} routing vs SMG {summary['smg_version']}, "
        f"series {summary['series_label']}; hit rate: median over reps "
        "[min-max]; prefill tokens summed; TTFT pooled over the reps"
    )
    head = (
        f"{'workload':<16}{'policy':<22}{'hit rate':>9}{'[min-max]':>12}"
        f"{'/rr':>6}{'prefill':>9}{'/rr':>6}{'host sh':>8}{'split':>9}"
        f"{'p50 s':>7}{'p90 s':>7}{'/rr':>6}{'reps':>5}"
    )
    for workload, rows in summary["workloads"].items():
        print(f"\n{head}")
        for policy, s in rows.items():
            split = "/".join(str(n) for n in s["requests_per_rank"])
            spread = f"{s['hit_rate_min']:.2f}-{s['hit_rate_max']:.2f}"
            print(
                f"{workload:<16}{policy:<22}{s['hit_rate']:>9.3f}{spread:>12}"
                f"{fmt_or_dash(s['hit_rate_vs_rr'], '>6.2f')}{s['prefill_tokens']:>9d}"
                f"{fmt_or_dash(s['prefill_tokens_vs_rr'], '>6.2f')}{s['host_share']:>8.3f}"
                f"{split:>9}{s['ttft_p50_s']:>7.3f}{s['ttft_p90_s']:>7.3f}"
                f"{fmt_or_dash(s['ttft_p90_s_vs_rr'], '>6.2f')}{s['reps']:>5}"
            )
    print("\nservers (start s, error-like log lines, routing outcomes):")
    for s in servers:
        if "error" in s:
            print(f"  {s['policy']:<22}{s['group']:<10} FAILED (see JSON)")
            continue
        outcomes = ", ".join(
            f"{k} {int(v)}" for k, v in sorted(s["routing_outcomes"].items()) if v
        )
        print(
            f"  {s['policy']:<22}{s['group']:<10}{s['start_s']:>5.0f} s"
            f"{s['log_errors']['count']:>5}  {outcomes or '-'}"
        )


def _plot(summary, policies, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(summary["workloads"])
    fig, axes = plt.subplots(2, 1, figsize=(15, 8))
    width = 0.8 / max(1, len(policies))
    for ax, key, title in (
        (axes[0], "hit_rate", "prefix hit rate (median over reps, min-max)"),
        (axes[1], "ttft_p90_s", "client TTFT p90 in s (pooled over reps)"),
    ):
        for j, p in enumerate(policies):
            xs, ys, err = [], [], [[], []]
            for i, w in enumerate(workloads):
                s = summary["workloads"][w].get(p)
                if s is None:
                    continue
                xs.append(i + j * width)
                ys.append(s[key])
                lo = s[key] - s.get(key + "_min", s[key])
                hi = s.get(key + "_max", s[key]) - s[key]
                err[0].append(lo)
                err[1].append(hi)
            ax.bar(xs, ys, width, yerr=err, capsize=2, label=p)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))])
        ax.set_xticklabels(workloads, fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle(
        f"DP={DP} routing vs SMG {summary['smg_version']}, "
        f"series {summary['series_label']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
