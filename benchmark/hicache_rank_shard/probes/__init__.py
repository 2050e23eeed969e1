"""Single-question GPU probes behind the rank-shard benchmark's design choices."""
