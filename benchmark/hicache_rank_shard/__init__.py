"""Rank-sharded HiCache host tier: geometry, the GPU runner, live CPU servers."""
