"""Decode-side HiCache admission: upstream against the patched tree on CPU."""
