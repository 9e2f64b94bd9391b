"""fsdpfn.testing: results in rank order, failures carry the rank's traceback, hangs time out,
a broken pool is replaced so the next call works, and a function the spawned ranks cannot find
is refused (or reported) with how to fix it."""

import os
import signal
import subprocess
import sys
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
    with pytest.raises(testing.RankError, match=r"rank 0 did not finish within 3 s") as info:
        testing.run_on_ranks(_hangs_on_zero, 2, timeout=3)
    assert time.monotonic() - start < 30
    # Where it hung: the rank's own Python stack, down to the line that waits.
    assert "in _hangs_on_zero" in str(info.value) and "time.sleep(60)" not in str(info.value), str(info.value)
    assert list(info.value.errors) == [0]
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


def _stops_on_one(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.2)
    raise ValueError("rank zero gives up")


def test_a_stopped_rank_is_not_waited_for_after_another_failed():
    before = [r[4] for r in testing.run_on_ranks(_identity, 2, "warm")]  # time the call, not a pool start
    start = time.monotonic()
    with pytest.raises(testing.RankError) as info:
        testing.run_on_ranks(_stops_on_one, 2, timeout=60)
    # The stopped rank can never answer: it is named at the next look (once a second), not after
    # the 5 s given to ranks that may still report; 1.5 s of slack for a busy machine.
    assert time.monotonic() - start < 0.2 + 1.0 + 1.5
    assert "rank zero gives up" in info.value.errors[0]
    assert "is stopped (SIGSTOP or a debugger): it did not finish after another rank failed" in info.value.errors[1]
    after = testing.run_on_ranks(_identity, 2, "after")  # a fresh pool replaced the one holding a stopped rank
    assert [r[:3] for r in after] == [(0, 2, "after"), (1, 2, "after")] and set(r[4] for r in after).isdisjoint(before)


def test_bad_world_size():
    with pytest.raises(ValueError, match="positive int"):
        testing.run_on_ranks(_identity, 0, "x")


# ---- functions the spawned ranks cannot find ---------------------------------------------------

_SCRIPTS = {
    # The launch runs at import time: every spawned rank would import the script and launch again.
    "unguarded": """
import sys
sys.path.insert(0, {root!r})
from fsdpfn.testing import run_on_ranks

def f(rank, world):
    return rank

print(run_on_ranks(f, 2, timeout=60))
""",
    # The function exists only under the guard, which a spawned rank does not run.
    "defined under the guard": """
import functools, sys
sys.path.insert(0, {root!r})
from fsdpfn.launch import launch

if __name__ == "__main__":
    def f(rank, world, k):
        return rank * k

    print(launch(functools.partial(f, k=3), 2))
""",
    # The right way: the function at the top level, the launch under the guard.
    "right": """
import sys
sys.path.insert(0, {root!r})
from fsdpfn.testing import run_on_ranks

def f(rank, world):
    return rank * 10

def main():
    print("RESULT", run_on_ranks(f, 2, timeout=60))

if __name__ == "__main__":
    main()
""",
}


def _run_script(tmp_path, name):
    root = os.path.dirname(os.path.dirname(os.path.abspath(testing.__file__)))
    script = tmp_path / "job.py"
    script.write_text(_SCRIPTS[name].format(root=root))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_a_launch_outside_the_main_guard_is_refused_with_the_fix(tmp_path):
    proc = _run_script(tmp_path, "unguarded")
    err = proc.stderr
    # Refused in the parent, before any rank starts: no rank died, the reason is in the error.
    assert "ValueError: run_on_ranks(fn) is called at the top level of" in err and "(line 9)" in err, err
    assert 'Put the call under `if __name__ == "__main__":`' in err, err
    assert "rank 0 died" not in err and "bootstrapping phase" not in err, err


@pytest.mark.e2e
def test_a_function_defined_under_the_main_guard_is_refused_with_the_fix(tmp_path):
    proc = _run_script(tmp_path, "defined under the guard")
    err = proc.stderr
    assert "ValueError: launch(main) is 'f', defined under `if __name__ == \"__main__\":`" in err, err
    assert "Define 'f' at the top level of the file" in err and "importable module" in err, err


@pytest.mark.e2e
def test_a_function_at_the_top_level_with_a_guarded_launch_runs(tmp_path):
    proc = _run_script(tmp_path, "right")
    assert "RESULT [0, 10]" in proc.stdout, proc.stdout + proc.stderr


def _only_in_parent(rank, world):
    return rank


def test_a_function_a_rank_cannot_load_comes_back_with_the_reason():
    # A function the parent can pickle by name but a spawned rank cannot find (made at run time):
    # the rank reports why instead of dying with an exit code, and the pool stays usable.
    before = [r[4] for r in testing.run_on_ranks(_identity, 2, "before")]

    def made_here(rank, world):
        return rank

    made_here.__qualname__ = made_here.__name__ = "_made_at_run_time"
    globals()["_made_at_run_time"] = made_here
    try:
        with pytest.raises(testing.RankError) as info:
            testing.run_on_ranks(made_here, 2)
    finally:
        del globals()["_made_at_run_time"]
    for rank in (0, 1):
        text = info.value.errors[rank]
        assert "could not load run_on_ranks(fn)" in text and "_made_at_run_time" in text, text
        assert "define the function at the top level of an importable module" in text, text
    assert [r[4] for r in testing.run_on_ranks(_identity, 2, "after")] == before
