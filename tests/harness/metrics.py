"""Prometheus series of a live server's ``/metrics`` page."""

from __future__ import annotations

import re


def scrape(text: str, name: str) -> dict:
    """``{labels: value}`` of one Prometheus series in a /metrics page."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[tuple(sorted(labels.items()))] = float(m.group(2))
    return out


def routing_outcomes(server) -> dict:
    """``sglang:dp_routing_requests_total`` by outcome (cache-aware DP
    routing), summed over any other label."""
    out: dict = {}
    text = server.get("/metrics").text
    for labels, value in scrape(text, "sglang:dp_routing_requests_total").items():
        how = dict(labels)["outcome"]
        out[how] = out.get(how, 0.0) + value
    return out


def total(text: str, name: str) -> float:
    """One Prometheus series of a /metrics page summed over its labels."""
    return sum(scrape(text, name).values())


# Bytes each TP rank of a rank-sharded host tier wrote to and read from L3.
L3_METRIC = "sglang:hicache_rank_shard_l3_bytes_total"


def l3_counters(server) -> dict:
    """(tp_rank, direction) -> bytes of the rank-sharded L3 counter, from the
    server's /metrics (any L3 backend)."""
    out = {}
    for labels, value in scrape(server.get("/metrics").text, L3_METRIC).items():
        labels = dict(labels)
        out[(int(labels["tp_rank"]), labels["direction"])] = int(value)
    return out
