"""Summarise a torch.profiler (Kineto) chrome trace of one load-back.

``gpu_tp_run.py --trace`` profiles one extra load (CPU + CUDA activities) with
the layer loop annotated (``rs.load`` around the submission, ``rs.copy.<l>``
around each layer's host copy, ``rs.exchange.<l>`` around its exchange) and
keeps only this summary, not the trace:

* per CUDA stream: its role, busy time (union of intervals) and the busy time
  of each class of work (HtoD memcpy, NCCL, gather = index_select, scatter =
  index_copy, other);
* the idle gaps of the H2D stream (the one with the most HtoD bytes) between
  its first and last op, each split into *cpu* (the next op was launched on
  the host after the previous op ended: the stream waited for the CPU) and
  *dependency* (it was launched in time and waited for something else);
* per layer: the GPU span of its host copy and of its exchange, and when the
  exchange starts after the copy (times in ms from the start of ``rs.load``);
* the tail: how long the load's GPU work runs after the last host copy;
* HtoD memcpy bandwidth with and without a kernel running beside it.

Only the standard library; the CPU test feeds it synthetic event lists.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict

COPY, EXCHANGE, LOAD = "rs.copy.", "rs.exchange.", "rs.load"
CLASSES = ("memcpy_htod", "nccl", "gather", "scatter", "memcpy_other", "other")
GAP_MIN_US = 5.0  # smaller idle slivers between back-to-back ops are not gaps


def classify(event: dict) -> str:
    name = event.get("name", "")
    cat = event.get("cat", "")
    low = name.lower()
    if cat == "gpu_memcpy":
        return "memcpy_htod" if "htod" in low else "memcpy_other"
    if "nccl" in low:
        return "nccl"
    if "index_select" in low or "indexselect" in low or "gather" in low:
        return "gather"
    if "index_copy" in low or "indexcopy" in low:
        return "scatter"
    return "other"


def _union(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _overlap(a0, a1, intervals) -> float:
    """Time of [a0, a1) covered by the (sorted, merged) ``intervals``."""
    return sum(max(0.0, min(a1, e) - max(a0, s)) for s, e in intervals)


def _merge(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def summarize(events: list, max_gaps: int = 12) -> dict:
    """The summary of one load-back's trace events (chrome-trace dicts)."""
    xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
    annotations = [e for e in xs if e.get("cat") == "user_annotation"]
    loads = [e for e in annotations if e["name"] == LOAD]
    t0 = loads[0]["ts"] if loads else min((e["ts"] for e in xs), default=0.0)
    launch_ts = {}  # correlation id -> host time of the runtime/driver call
    calls = defaultdict(lambda: [0, 0.0, 0.0])  # name -> count, total, max (us)
    for e in xs:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = calls[e["name"]]
            c[0] += 1
            c[1] += e.get("dur", 0.0)
            c[2] = max(c[2], e.get("dur", 0.0))
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launch_ts[corr] = e["ts"]
    # Layer annotations (host side), sorted by start, for attribution.
    spans = []
    for e in annotations:
        m = re.fullmatch(r"rs\.(copy|exchange)\.(\d+)", e["name"])
        if m:
            spans.append((e["ts"], e["ts"] + e.get("dur", 0.0), m[1], int(m[2])))
    spans.sort()
    starts = [s[0] for s in spans]

    def attribute(ts):
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and spans[i][0] <= ts <= spans[i][1]:
            return spans[i][2], spans[i][3]
        return None, None

    gpu = []
    for e in xs:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e.get("args") or {}
        corr = args.get("correlation")
        launch = launch_ts.get(corr)
        kind, layer = attribute(launch) if launch is not None else (None, None)
        gpu.append(
            dict(
                ts=e["ts"],
                end=e["ts"] + e.get("dur", 0.0),
                stream=args.get("stream"),
                cls=classify(e),
                name=e.get("name", ""),
                bytes=args.get("bytes", 0) or 0,
                launch=launch,
                kind=kind,
                layer=layer,
            )
        )
    gpu.sort(key=lambda g: g["ts"])
    if not gpu:
        return dict(gpu_ops=0, annotated_spans=len(spans))

    by_stream = defaultdict(list)
    for g in gpu:
        by_stream[g["stream"]].append(g)
    htod_bytes = {
        s: sum(g["bytes"] for g in ops if g["cls"] == "memcpy_htod")
        for s, ops in by_stream.items()
    }
    h2d = max(htod_bytes, key=lambda s: htod_bytes[s])
    streams = []
    for s, ops in sorted(by_stream.items(), key=lambda kv: kv[1][0]["ts"]):
        per = {
            c: _ms(_union([(g["ts"], g["end"]) for g in ops if g["cls"] == c]))
            for c in CLASSES
        }
        per = {c: v for c, v in per.items() if v}
        counts = defaultdict(int)
        for g in ops:
            counts[g["cls"]] += 1
        if s == h2d:
            role = "h2d"
        elif counts["nccl"] and counts["nccl"] == len(ops):
            role = "nccl"
        elif counts["gather"] or counts["scatter"]:
            role = "exchange"
        else:
            role = "other"
        streams.append(
            dict(
                stream=s,
                role=role,
                ops=len(ops),
                counts=dict(counts),
                first_ms=_ms(ops[0]["ts"] - t0),
                last_end_ms=_ms(max(g["end"] for g in ops) - t0),
                busy_ms=_ms(_union([(g["ts"], g["end"]) for g in ops])),
                busy_by_class_ms=per,
                htod_bytes=htod_bytes[s],
            )
        )

    # Idle gaps of the H2D stream, split by what it waited for.
    h2d_ops = by_stream[h2d]
    gaps, idle = [], dict(cpu=0.0, dependency=0.0)
    prev_end = h2d_ops[0]["end"]
    for g in h2d_ops[1:]:
        gap = g["ts"] - prev_end
        if gap > GAP_MIN_US:
            cause = (
                "cpu"
                if g["launch"] is not None and g["launch"] >= prev_end
                else "dependency"
            )
            idle[cause] += gap
            gaps.append(
                dict(
                    at_ms=_ms(prev_end - t0),
                    gap_ms=_ms(gap),
                    cause=cause,
                    next=g["cls"],
                    next_layer=g["layer"],
                    next_launched_ms=(
                        _ms(g["launch"] - t0) if g["launch"] is not None else None
                    ),
                )
            )
        prev_end = max(prev_end, g["end"])
    gaps.sort(key=lambda d: -d["gap_ms"])

    # Per layer: host copy span (HtoD memcpys attributed to rs.copy.<l>) and
    # exchange span (everything attributed to rs.exchange.<l>).
    layers = defaultdict(lambda: defaultdict(list))
    for g in gpu:
        if g["layer"] is not None:
            layers[g["layer"]][g["kind"]].append(g)
    host = {}
    for s0, s1, kind, layer in spans:
        host.setdefault(layer, {})[kind] = s0
    per_layer, last_copy_end = [], None
    for layer in sorted(set(layers) | set(host)):
        copies = [g for g in layers[layer]["copy"] if g["cls"] == "memcpy_htod"]
        xchg = layers[layer]["exchange"]
        row = dict(layer=layer)
        if layer in host and "copy" in host[layer]:
            row["cpu_copy_ms"] = _ms(host[layer]["copy"] - t0)
        if copies:
            row["copy_ms"] = [
                _ms(min(g["ts"] for g in copies) - t0),
                _ms(max(g["end"] for g in copies) - t0),
            ]
            last_copy_end = max(g["end"] for g in copies)
        if xchg:
            x0 = min(g["ts"] for g in xchg)
            row["exchange_ms"] = [_ms(x0 - t0), _ms(max(g["end"] for g in xchg) - t0)]
            for c in ("nccl", "gather", "scatter"):
                busy = _union([(g["ts"], g["end"]) for g in xchg if g["cls"] == c])
                if busy:
                    row[c + "_ms"] = _ms(busy)
            if last_copy_end is not None:
                # After this rank's latest host copy (its own, when it owns
                # the layer; the exchange cannot start before it).
                row["exchange_after_copy_ms"] = _ms(x0 - last_copy_end)
        per_layer.append(row)

    htod = [g for g in h2d_ops if g["cls"] == "memcpy_htod"]
    kernels = _merge(
        [(g["ts"], g["end"]) for g in gpu if g["cls"] not in ("memcpy_htod",)]
    )
    alone = [0, 0.0]
    beside = [0, 0.0]
    for g in htod:
        dur = g["end"] - g["ts"]
        acc = (
            beside if dur and _overlap(g["ts"], g["end"], kernels) >= dur / 2 else alone
        )
        acc[0] += g["bytes"]
        acc[1] += dur
    copy_first = htod[0]["ts"] if htod else h2d_ops[0]["ts"]
    copy_last = max(g["end"] for g in htod) if htod else h2d_ops[-1]["end"]
    gpu_end = max(g["end"] for g in gpu)
    nccl = [g["end"] - g["ts"] for g in gpu if g["cls"] == "nccl"]
    return dict(
        gpu_ops=len(gpu),
        annotated_spans=len(spans),
        cpu_submit_ms=_ms(loads[0].get("dur", 0.0)) if loads else None,
        first_copy_ms=_ms(copy_first - t0),
        last_copy_end_ms=_ms(copy_last - t0),
        gpu_end_ms=_ms(gpu_end - t0),
        copy_span_ms=_ms(copy_last - copy_first),
        copy_busy_ms=_ms(_union([(g["ts"], g["end"]) for g in htod])),
        htod_bytes=sum(g["bytes"] for g in htod),
        tail_after_last_copy_ms=_ms(gpu_end - copy_last),
        h2d_idle_ms=dict(
            total=_ms(idle["cpu"] + idle["dependency"]),
            cpu=_ms(idle["cpu"]),
            dependency=_ms(idle["dependency"]),
        ),
        h2d_gaps=len(gaps),
        h2d_largest_gaps=gaps[:max_gaps],
        htod_gbps=dict(
            alone=round(alone[0] / alone[1] / 1e3, 2) if alone[1] else None,
            beside_kernels=round(beside[0] / beside[1] / 1e3, 2) if beside[1] else None,
            bytes_beside_kernels=beside[0],
        ),
        nccl_kernels=dict(
            count=len(nccl),
            total_ms=_ms(sum(nccl)),
            mean_ms=_ms(sum(nccl) / len(nccl)) if nccl else None,
            max_ms=_ms(max(nccl)) if nccl else None,
        ),
        other_kernels=sorted(
            {g["name"][:80] for g in gpu if g["cls"] == "other" and g["name"]}
        )[:6],
        runtime_calls=[
            dict(name=n, count=c, total_ms=_ms(t), max_ms=_ms(m))
            for n, (c, t, m) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:8]
        ],
        streams=streams,
        layers=per_layer,
    )
