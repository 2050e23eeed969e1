"""Per-feature scenarios: functions run on gloo ranks that return plain
data (lists, dicts, bytes) for tests to assert on or compare."""
