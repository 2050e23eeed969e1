"""Builders of real sglang objects on CPU: radix trees, DSA (MLA KV +
indexer) stacks with their HiCache host tier, PD decode workers."""
