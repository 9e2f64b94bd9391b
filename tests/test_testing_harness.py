"""fsdpfn.testing: results in rank order, failures carry the rank's traceback, hangs time out,
and a broken pool is replaced so the next call works."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from fsdpfn import testing


def _identity(rank, world, tag):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, world, tag, t.item(), os.getpid()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_results_in_rank_order_and_pool_is_reused(world):
    first = testing.run_on_ranks(_identity, world, "a")
    second = testing.run_on_ranks(_identity, world, "b")
    assert [r[:4] for r in first] == [(r, world, "a", float(sum(range(world)))) for r in range(world)]
    assert [r[4] for r in first] == [r[4] for r in second]  # same processes: groups started once
    assert len({r[4] for r in first}) == world and os.getpid() not in {r[4] for r in first}


def _fails_on_one(rank, world):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(testing.RankError) as info:
        testing.run_on_ranks(_fails_on_one, 2)
    message = str(info.value)
    assert "rank 1 raised" in message and "ValueError: rank one is unhappy" in message and "_fails_on_one" in message
    assert "rank 0 raised" not in message
    assert [r[:2] for r in testing.run_on_ranks(_identity, 2, "after")] == [(0, 2), (1, 2)]


def _hangs_on_zero(rank, world):
    if rank == 0:
        time.sleep(60)
    return rank


def test_a_hang_fails_by_timeout_and_the_pool_recovers():
    before = [r[4] for r in testing.run_on_ranks(_identity, 2, "before")]
    start = time.monotonic()
    with pytest.raises(testing.RankError, match=r"rank\(s\) \[0\] did not finish within 3 s"):
        testing.run_on_ranks(_hangs_on_zero, 2, timeout=3)
    assert time.monotonic() - start < 30
    after = testing.run_on_ranks(_identity, 2, "after")
    assert [r[:3] for r in after] == [(0, 2, "after"), (1, 2, "after")]
    assert set(r[4] for r in after).isdisjoint(before)  # a fresh pool replaced the stuck one


def _collective_mismatch(rank, world):
    if rank == 1:
        raise RuntimeError("bailed before the collective")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a partner that never comes
    return rank


def test_a_rank_stuck_in_a_collective_after_another_failed_is_reported():
    with pytest.raises(testing.RankError) as info:
        testing.run_on_ranks(_collective_mismatch, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 raised" in message and "bailed before the collective" in message
    assert "rank(s) [0] did not finish after another rank failed" in message
    assert testing.run_on_ranks(_identity, 2, "ok")[0][2] == "ok"


def test_bad_world_size():
    with pytest.raises(ValueError, match="positive int"):
        testing.run_on_ranks(_identity, 0, "x")
