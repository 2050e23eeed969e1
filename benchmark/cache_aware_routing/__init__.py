"""Cache-aware DP routing: the trace simulation and the live CPU servers."""
