"""Ordering of rank-shard broadcasts against the forward's collectives.

1. A model of one scheduler loop per TP rank: the forward stream issues the
   forward's collectives on the TP communicator, ``start_loading`` puts the
   load fence and the per-layer exchange broadcasts (shard communicator) on the
   H2D stream, and the next forward follows. A GPU runs one spinning
   collective at a time (NCCL's rule for concurrent communicators), streams
   advance in any order. Every interleaving is explored: without the forward
   gate the model finds a deadlock and a cross-rank misordering; with it, none.
2. The real code paths: ``start_loading`` publishes the finish event of the
   exchange it submitted; ``LayerDoneCounter.set_consumer`` and
   ``Scheduler.run_batch`` wait on it before the forward's first kernel.
"""

import unittest
from dataclasses import dataclass

from sglang.test.ci.ci_register import register_cpu_ci

from harness.gloo_ranks import run_ranks
from harness.scenarios.hicache_rank_shard_scenarios import (
    gate_paths,
    require_rank_shard,
)

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
FEATURE_GROUP = "hicache-rank-shard"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "TestOrderingModel.test_without_gate_deadlocks_and_misorders": "a pure model "
    "of the ordering problem the PR's forward gate solves (no sglang code)",
    "TestOrderingModel.test_with_gate_no_deadlock_no_misorder": "a pure model "
    "of the ordering problem the PR's forward gate solves (no sglang code)",
    "TestOrderingModel.test_fence_is_needed_too": "a pure model "
    "of the ordering problem the PR's forward gate solves (no sglang code)",
}


# ------------------------------------------------------------------- the model
def rank_program(iterations: int, layers: int, gated: bool):
    """(stream, op) lists of one rank; ops: ('coll', comm, tag), ('record', ev),
    ('wait', ev)."""
    fwd, h2d = [], []
    for n in range(iterations):
        if n and gated:
            fwd.append(("wait", f"E{n - 1}"))  # forward gate
        fwd += [("coll", "tp", f"F{n}.attn"), ("coll", "tp", f"F{n}.moe")]
        fwd.append(("record", f"F{n}"))
        if n + 1 < iterations:  # start_loading for the next batch
            h2d.append(("wait", f"F{n}"))  # load fence: wait_stream(forward)
            h2d += [("coll", "shard", f"E{n}.L{l}") for l in range(layers)]
            h2d.append(("record", f"E{n}"))
    return {"fwd": fwd, "h2d": h2d}


@dataclass
class Outcome:
    states: int
    deadlocks: int
    misorders: int
    completed: int


def explore(ranks: int, iterations: int, layers: int, gated: bool, slots: int = 1):
    progs = [rank_program(iterations, layers, gated) for _ in range(ranks)]
    streams = ("fwd", "h2d")
    # state: per rank (ptr per stream, launched collectives, recorded events),
    # plus per rank the order in which it launched collectives.
    start = tuple((0, 0, frozenset(), frozenset()) for _ in range(ranks))
    # finished: collectives every rank has launched (they complete everywhere)
    seen, stack = set(), [(start, tuple(() for _ in range(ranks)), frozenset())]
    out = Outcome(0, 0, 0, 0)

    def head(r, s, state):
        ptr = state[r][streams.index(s)]
        prog = progs[r][s]
        return prog[ptr] if ptr < len(prog) else None

    while stack:
        state, orders, finished = stack.pop()
        key = (state, orders, finished)
        if key in seen:
            continue
        seen.add(key)
        out.states += 1
        moves = []
        for r in range(ranks):
            ptrs = list(state[r][:2])
            launched, recorded = state[r][2], state[r][3]
            for si, s in enumerate(streams):
                op = head(r, s, state)
                if op is None:
                    continue
                kind = op[0]
                if kind == "record":
                    moves.append((r, si, None, frozenset([op[1]])))
                elif kind == "wait" and op[1] in recorded:
                    moves.append((r, si, None, frozenset()))
                elif kind == "coll":
                    tag = op[2]
                    if tag in launched:
                        # completes once every rank has launched it
                        if tag in finished or all(
                            tag in state[q][2] for q in range(ranks)
                        ):
                            moves.append((r, si, ("done", tag), frozenset()))
                    elif len(launched) < slots:
                        moves.append((r, si, ("launch", tag), frozenset()))
        if not moves:
            done = all(head(r, s, state) is None for r in range(ranks) for s in streams)
            if done:
                out.completed += 1
                if len(set(orders)) > 1:
                    out.misorders += 1
            else:
                out.deadlocks += 1
            continue
        for r, si, coll, rec in moves:
            ptrs, launched, recorded = list(state[r][:2]), state[r][2], state[r][3]
            order = orders[r]
            if coll is None:
                ptrs[si] += 1
            elif coll[0] == "launch":
                launched = launched | {coll[1]}
                order = order + (coll[1],)
            else:
                launched = launched - {coll[1]}
                ptrs[si] += 1
            new_rank = (ptrs[0], ptrs[1], launched, recorded | rec)
            new_state = state[:r] + (new_rank,) + state[r + 1 :]
            new_orders = orders[:r] + (order,) + orders[r + 1 :]
            done = finished | {coll[1]} if coll and coll[0] == "done" else finished
            stack.append((new_state, new_orders, done))
    return out


class TestOrderingModel(unittest.TestCase):
    def test_without_gate_deadlocks_and_misorders(self):
        out = explore(ranks=2, iterations=2, layers=2, gated=False)
        self.assertGreater(out.deadlocks, 0, out)
        # with room for two concurrent collectives it completes, but ranks
        # then disagree on the order of shard and TP collectives
        out2 = explore(ranks=2, iterations=2, layers=2, gated=False, slots=2)
        self.assertGreater(out2.misorders, 0, out2)

    def test_with_gate_no_deadlock_no_misorder(self):
        for ranks, iterations, layers, slots in [
            (2, 3, 2, 1),
            (3, 2, 2, 1),
            (2, 3, 2, 2),
        ]:
            out = explore(ranks, iterations, layers, gated=True, slots=slots)
            self.assertGreater(out.completed, 0, out)
            self.assertEqual((out.deadlocks, out.misorders), (0, 0), (ranks, out))

    def test_fence_is_needed_too(self):
        """Sanity of the model: dropping the load fence (gate kept) lets an
        exchange overtake the forward it must follow."""
        original = rank_program

        def no_fence(iterations, layers, gated):
            prog = original(iterations, layers, gated)
            prog["h2d"] = [op for op in prog["h2d"] if op[0] != "wait"]
            return prog

        globals()["rank_program"] = no_fence
        try:
            out = explore(2, 2, 2, gated=True)
        finally:
            globals()["rank_program"] = original
        self.assertGreater(out.deadlocks, 0, out)


# ------------------------------------------------------------ the real paths
class TestRealGatePaths(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        require_rank_shard()
        cls.results = run_ranks(
            gate_paths, 2, timeout=900, env={"SGLANG_ENABLE_HICACHE_RANK_SHARD": "1"}
        )

    def test_scheduler_and_layer_counter_get_the_contexts_gate(self):
        for r in self.results:
            self.assertTrue(r["one_gate"])

    def test_start_loading_publishes_the_exchange_finish_event(self):
        for r in self.results:
            self.assertTrue(r["gate_is_last_ack_finish"])
            self.assertTrue(r["gate_replaced_by_second_load"])

    def test_set_consumer_waits_on_it(self):
        for r in self.results:
            self.assertEqual(r["set_consumer_waited"], [r["last_event_id"]])

    def test_run_batch_waits_before_the_forward(self):
        for r in self.results:
            self.assertEqual(
                r["run_batch_overlap_waited"], [("forward", r["last_event_id"])]
            )
            self.assertEqual(
                r["run_batch_plain_waited"], [("current", r["last_event_id"])]
            )
            self.assertTrue(r["run_batch_stopped_after_gate"])


if __name__ == "__main__":
    unittest.main()
