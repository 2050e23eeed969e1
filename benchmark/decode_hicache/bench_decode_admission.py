"""Decode-side HiCache admission: upstream 0.5.23 vs the patched series, side by side.

Both columns run the same seeded workloads through real ``UnifiedRadixCache``
(HiCache host tier, L3 file backend) and decode-queue objects on CPU
(``tests/harness/stacks/decode_hicache_stack.py``; stand-ins only for the KV
receiver, the two ``kvcacheio`` direct ops and pinned memory), each in a fresh
interpreter:
``upstream`` is the pristine pinned wheel with upstream's greedy admission,
``patched`` is the built series with ``--disaggregation-decode-enable-hicache``
(host-span lock, read-only pre-check, batched planning, two-phase L3).

* ``admission``: decode admission under device and host memory pressure
  (requests share a few long prefixes; unrelated traffic churns the host
  tier; load-back slots are busy so restores wait a few steps). Reported per
  run: requests admitted per step, ``evict_for_alloc`` calls and tokens
  evicted, L1 hit and L2 restore tokens, failed restores (the request is
  aborted with HTTP 500), tokens prefill must send, mean steps waiting.
* ``l3``: a prefix that lives only in L3 storage; upstream promises the L3
  span at admission and loads it afterwards, the patched queue holds the
  request until the prefetch has landed in host memory and promises only
  that. Reported per prefetch policy: steps and seconds to admission, seconds
  to the restore outcome, outcome, tokens promised.

Ratios are patched / upstream of the same run. Run with the project venv
(``make install`` first): ``python -m benchmark.decode_hicache.bench_decode_admission [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmark.bench_meta import run_dir, run_metadata
from harness.compare import run_scenario

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


SIM = "harness.scenarios.decode_hicache_scenarios:admission_sim"
L3 = "harness.scenarios.decode_hicache_scenarios:l3_two_phase"

CONFIGS = [
    # name, device tokens, host ratio, host churn tokens / step, restore every
    ("device-pressure", 1536, 1.2, 0, 1),
    ("host-churn", 1536, 1.2, 512, 4),
    ("host-churn-large", 2048, 1.5, 1024, 4),
]
POLICIES = ("best_effort", "timeout", "wait_complete")


def _sim(which, seed_flag, cfg, seed, steps):
    name, size, ratio, churn, every = cfg
    (r,) = run_scenario(
        which,
        SIM,
        1,
        timeout=900,
        seed_flag=seed_flag,
        seed=seed,
        steps=steps,
        size=size,
        hicache_ratio=ratio,
        host_churn_tokens=churn,
        restore_every=every,
        arrivals=(1, 4),
        num_prefixes=10,
        lifetime=(4, 8),
    )
    return r["totals"], r["per_step"]


def run_admission(seeds, steps):
    rows = []
    for cfg in CONFIGS:
        agg = {}
        for which, seed_flag in (("upstream", False), ("patched", True)):
            tot = {}
            for seed in seeds:
                t, _ = _sim(which, seed_flag, cfg, seed, steps)
                for k, v in t.items():
                    tot[k] = tot.get(k, 0) + v
            n = len(seeds)
            agg[which] = dict(
                admitted_per_step=tot["admitted"] / (steps * n),
                evict_calls=tot["evict_calls"],
                evicted_tokens=tot["evicted_tokens"],
                l1_hit_tokens=tot["l1_tokens"],
                l2_restore_tokens=tot["l2_tokens"],
                failed_restores=tot["failed_restores"],
                prefill_sent_tokens=tot["input_tokens"] - tot["promised_tokens"],
                mean_wait_steps=tot["mean_wait_steps"] / n,
                admitted=tot["admitted"],
            )
        ratios = {
            k: (agg["patched"][k] / agg["upstream"][k] if agg["upstream"][k] else None)
            for k in agg["upstream"]
        }
        rows.append(dict(config=cfg[0], params=cfg[1:], **agg, ratio=ratios))
    return rows


def run_l3(prefix_sizes):
    rows = []
    for tokens in prefix_sizes:
        for policy in POLICIES:
            row = dict(prefix_tokens=tokens, policy=policy)
            for which, seed_flag in (("upstream", False), ("patched", True)):
                with tempfile.TemporaryDirectory() as d:
                    (r,) = run_scenario(
                        which,
                        L3,
                        1,
                        timeout=300,
                        seed_flag=seed_flag,
                        storage_dir=d,
                        policy=policy,
                        prefix_tokens=tokens,
                    )
                row[which] = {
                    k: r.get(k)
                    for k in (
                        "admitted_at",
                        "seconds_to_admit",
                        "seconds_to_outcome",
                        "status",
                        "promised",
                        "l2",
                        "l3",
                        "restored_bytes_equal",
                    )
                }
            rows.append(row)
    return rows


def _print_admission(rows):
    print(
        "\nadmission under memory pressure (sum over seeds; ratio = patched/upstream)"
    )
    keys = (
        "admitted_per_step",
        "evict_calls",
        "evicted_tokens",
        "l1_hit_tokens",
        "l2_restore_tokens",
        "failed_restores",
        "prefill_sent_tokens",
        "mean_wait_steps",
    )
    print(f"{'config':<18}{'metric':<20}{'upstream':>10}{'patched':>10}{'ratio':>8}")
    for row in rows:
        for k in keys:
            ratio = row["ratio"][k]
            print(
                f"{row['config']:<18}{k:<20}{row['upstream'][k]:>10.2f}"
                f"{row['patched'][k]:>10.2f}{(f'{ratio:.2f}' if ratio else '-'):>8}"
            )


def _print_l3(rows):
    print("\nL3-only prefix: upstream promise-then-load vs two-phase prefetch")
    print(
        f"{'tokens':>7} {'policy':<14}{'tree':<9}{'admit step':>11}{'admit s':>9}"
        f"{'outcome s':>10}{'outcome':>9}{'promised':>9}"
    )
    for row in rows:
        for which in ("upstream", "patched"):
            r = row[which]
            print(
                f"{row['prefix_tokens']:>7} {row['policy']:<14}{which:<9}"
                f"{r['admitted_at']:>11}{r['seconds_to_admit']:>9.3f}"
                f"{r['seconds_to_outcome']:>10.3f}{r['status']:>9}{r['promised']:>9}"
            )


def _plot(adm, l3, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [r["config"] for r in adm]
    x = range(len(adm))
    for ax, key, title in (
        (axes[0], "evicted_tokens", "tokens evicted (device)"),
        (axes[1], "l1_hit_tokens", "L1 prefix hit tokens"),
    ):
        ax.bar(
            [i - 0.2 for i in x],
            [r["upstream"][key] for r in adm],
            0.4,
            label="upstream",
        )
        ax.bar(
            [i + 0.2 for i in x], [r["patched"][key] for r in adm], 0.4, label="patched"
        )
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title)
    axes[0].legend()
    l3_labels = [f"{r['policy']}\n{r['prefix_tokens']}" for r in l3]
    for j, which in enumerate(("upstream", "patched")):
        vals = [r[which]["seconds_to_outcome"] for r in l3]
        bars = axes[2].bar(
            [i + (j - 0.5) * 0.4 for i in range(len(l3))], vals, 0.4, label=which
        )
        for b, r in zip(bars, l3):
            if r[which]["status"] != "ready":
                b.set_hatch("//")
    axes[2].set_xticks(list(range(len(l3))))
    axes[2].set_xticklabels(l3_labels, fontsize=7)
    axes[2].set_title("L3-only prefix: seconds to restore outcome (hatched: failed)")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CI smoke run")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    seeds = [0] if args.quick else [0, 1, 2]
    steps = 20 if args.quick else 40
    sizes = [256] if args.quick else [256, 512]

    t0 = time.perf_counter()
    adm = run_admission(seeds, steps)
    _print_admission(adm)
    l3 = run_l3(sizes)
    _print_l3(l3)

    os.makedirs(args.out, exist_ok=True)
    meta = {
        **run_metadata(),
        "params": {"seeds": seeds, "steps": steps, "configs": CONFIGS},
        "admission": adm,
        "l3": l3,
        "wall_s": time.perf_counter() - t0,
    }
    path = (
        run_dir(args.out, "decode-admission" + ("-quick" if args.quick else ""))
        / "bench_decode_admission.json"
    )
    path.write_text(json.dumps(meta, indent=2))
    png = path.with_suffix(".png")
    _plot(adm, l3, png)
    print(f"\nwrote {path.relative_to(ROOT)} and {png.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
