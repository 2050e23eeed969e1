"""Test-only stand-ins for what a CPU cannot run.

Nothing here is shipped: the wheel never contains ``tests/``. Each stand-in is
named as one and mimics the real operation's per-page semantics exactly.
"""
