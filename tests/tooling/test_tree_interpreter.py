"""The harness's rank runs: ``harness.gloo_ranks.run_ranks`` (results in rank
order, failures named with their traceback, hung ranks killed at the timeout,
per-run environment that does not leak into the next run) and the warm
interpreter of another sglang tree (``harness.tree_interpreter``: one tree per
interpreter)."""

from __future__ import annotations

import os
import time

import pytest

from harness.compare import run_scenario
from harness.gloo_ranks import RankAssertionError, RankFailure, run_ranks

ME = __name__


def rank_info(rank, world_size, *, key=None):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return dict(
        rank=rank,
        world=dist.get_world_size(),
        sum=int(t.item()),
        pid=os.getpid(),
        env=os.environ.get(key) if key else None,
    )


def fail_on(rank, world_size, *, bad, error=ValueError):
    if rank == bad:
        raise error(f"rank {rank} refuses")
    time.sleep(3600)  # a peer stuck in a collective


def sglang_asserts(rank, world_size):
    from sglang.srt.utils.common import assert_int64_array

    assert_int64_array([1, 2], "ids")  # not an array('q'): sglang's assert


def hang(rank, world_size, *, pid_file):
    with open(f"{pid_file}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)


def sglang_file(rank, world_size):
    import sglang

    return sglang.__file__


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone for our purposes only once reaped.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


def test_ranks_are_separate_processes_in_one_group():
    out = run_ranks(rank_info, 4, timeout=300, key="RANK_ENV_PROBE")
    assert [r["rank"] for r in out] == [0, 1, 2, 3]
    assert {r["world"] for r in out} == {4}
    assert {r["sum"] for r in out} == {10}
    assert len({r["pid"] for r in out}) == 4


def test_env_is_per_request():
    out = run_ranks(rank_info, 2, timeout=300, env={"RANK_ENV_PROBE": "x"})
    assert [r["env"] for r in out] == [None, None]  # key not asked for
    out = run_ranks(
        rank_info, 2, timeout=300, key="RANK_ENV_PROBE", env={"RANK_ENV_PROBE": "x"}
    )
    assert [r["env"] for r in out] == ["x", "x"]
    out = run_ranks(rank_info, 2, timeout=300, key="RANK_ENV_PROBE")
    assert [r["env"] for r in out] == [None, None]


def test_failing_rank_is_named_and_its_peers_killed():
    with pytest.raises(RankFailure) as err:
        run_ranks(fail_on, 3, timeout=300, bad=1)
    msg = str(err.value)
    assert "rank 1 failed (of 3; failed ranks [1], killed [0, 2])" in msg
    assert "ValueError: rank 1 refuses" in msg
    # an error of the test, not its failure: no AssertionError
    assert not isinstance(err.value, AssertionError)


def test_a_failed_check_in_a_rank_is_the_tests_own_assertion():
    # unittest (and pr-check's pristine rule) count it as the test failing
    # by its own assertion, not as an error
    with pytest.raises(RankAssertionError) as err:
        run_ranks(fail_on, 2, timeout=300, bad=1, error=AssertionError)
    assert isinstance(err.value, AssertionError)
    assert isinstance(err.value, RankFailure)
    msg = str(err.value)
    assert "rank 1 failed (of 2; failed ranks [1], killed [0])" in msg
    assert "AssertionError: rank 1 refuses" in msg


def test_an_assert_of_sglang_in_a_rank_is_an_error_not_the_tests_check():
    with pytest.raises(RankFailure) as err:
        run_ranks(sglang_asserts, 1, timeout=300)
    assert not isinstance(err.value, AssertionError), err.value
    assert "AssertionError: ids must be array('q')" in str(err.value)


def test_hung_ranks_are_killed_at_the_timeout(tmp_path):
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"timeout after 5s: ranks \[0, 1\]"):
        run_ranks(hang, 2, timeout=5, pid_file=str(tmp_path / "pid"))
    assert time.monotonic() - started < 120
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
    assert all(_gone(p) for p in pids)
    # The fork server serves the next run.
    assert run_ranks(rank_info, 1, timeout=300)[0]["sum"] == 1


def test_each_tree_has_its_own_interpreter():
    upstream = run_scenario("upstream", f"{ME}:sglang_file", 1, timeout=300)[0]
    patched = run_scenario("patched", f"{ME}:sglang_file", 1, timeout=300)[0]
    assert upstream != patched
    assert "upstream" in upstream


def test_local_functions_are_refused():
    def local(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="module-level function"):
        run_ranks(local, 1, timeout=60)
