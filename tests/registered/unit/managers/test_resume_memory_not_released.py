"""Resuming memory that was never released leaves the scheduler running.

On 0.5.23 one ``/resume_memory_occupation`` whose tags were not released
(none released yet: the default tags are every type; a tag resumed twice; an
unknown tag) took the whole server down: the scheduler's
``resume_memory_occupation`` removed each tag from its released set, the
``KeyError`` ended the scheduler's event loop and the launcher stopped every
process (found by the schema fuzz of every route, ``harness.schema_fuzz``).

The real ``SchedulerWeightUpdaterManager.resume_memory_occupation`` on a
manager with a recording memory saver: tags not released are left as they
are (no raise, nothing resumed), the released ones are resumed once.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_released_tags_are_resumed": "a released tag resumes as upstream resumes it",
}


class _MemorySaver:
    def __init__(self):
        self.calls = []

    def pause(self, tag):
        self.calls.append(("pause", tag))

    def resume(self, tag):
        self.calls.append(("resume", tag))


class TestResumeMemoryNotReleased(unittest.TestCase):
    def make(self, released):
        from sglang.srt.managers.scheduler_components.weight_updater import (
            SchedulerWeightUpdaterManager,
        )

        manager = object.__new__(SchedulerWeightUpdaterManager)
        manager.offload_tags = set(released)
        manager.memory_saver_adapter = _MemorySaver()
        manager.scheduler = None
        return manager

    def resume(self, manager, tags):
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        try:
            manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags))
        except Exception as e:  # the scheduler's event loop would end here
            self.fail(f"resume of {tags} raised {type(e).__name__}: {e}")

    def test_tags_not_released_are_left_as_they_are(self):
        for released, tags in (
            ((), None),
            ((), ["kv_cache"]),
            ((), ["no_such_tag"]),
            (("kv_cache",), None),  # the default tags: every type
            (("kv_cache",), ["kv_cache", "kv_cache"]),
        ):
            with self.subTest(released=released, tags=tags):
                manager = self.make(released)
                self.resume(manager, tags)
                self.assertEqual(manager.offload_tags, set())
                expected = [("resume", "kv_cache")] if released else []
                self.assertEqual(manager.memory_saver_adapter.calls, expected)

    def test_released_tags_are_resumed(self):
        manager = self.make({"kv_cache", "cuda_graph"})
        self.resume(manager, ["kv_cache", "cuda_graph"])
        self.assertEqual(manager.offload_tags, set())
        self.assertEqual(
            sorted(manager.memory_saver_adapter.calls),
            [("resume", "cuda_graph"), ("resume", "kv_cache")],
        )


if __name__ == "__main__":
    unittest.main()
