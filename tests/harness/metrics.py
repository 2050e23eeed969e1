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
