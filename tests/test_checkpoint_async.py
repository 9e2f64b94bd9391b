"""fsdpfn.checkpoint.async_save: the same checkpoint as save, written while training goes on.

Every comparison is bitwise (``torch.equal``) against a synchronous reference: the asynchronous
path moves the same bytes through a host copy and does no arithmetic.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdpfn import checkpoint
from test_checkpoint import _die_at, _full, _load_step1, _setup, _train


def _same(a, b) -> list[str]:
    """The paths where two ``_full`` dicts differ (empty: bitwise equal)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return sorted(p for p in a if not (torch.equal(a[p], b[p]) if isinstance(a[p], torch.Tensor) else a[p] == b[p]))


@contextlib.contextmanager
def _held_write(rank_to_hold=None):
    """DCP's file writes wait (on the thread that writes) until the event is set, on every rank or
    on ``rank_to_hold`` only; undone on exit (the worker process is reused)."""
    release = threading.Event()
    write_data = dcp.FileSystemWriter.write_data

    def held(self, plan, planner):
        release.wait(120)
        return write_data(self, plan, planner)

    import torch.distributed as dist

    if rank_to_hold is None or dist.get_rank() == rank_to_hold:
        dcp.FileSystemWriter.write_data = held
    try:
        yield release
    finally:
        release.set()
        dcp.FileSystemWriter.write_data = write_data


# ---- the same checkpoint as a synchronous save ----------------------------------------------------


def _async_vs_sync(rank, world, root_sync, root_async):
    model, plan, state = _setup(world, "zero3")
    state = _train(model, plan, state, 2, rank, world)
    checkpoint.save(root_sync, state, plan)
    pending = checkpoint.async_save(root_async, state, plan)
    assert pending.path == os.path.join(root_async, "step_00000002")
    assert pending.result() == pending.path and checkpoint.wait() is None
    loaded = []
    for root in (root_sync, root_async):
        _, plan2, template = _setup(world, "zero3", seed=3)
        loaded.append(_full(checkpoint.load(root, template, plan2)))
    return _same(loaded[0], loaded[1]), _same(loaded[1], _full(state))


def test_async_save_loads_bitwise_equal_to_a_synchronous_save(run_on_ranks, tmp_path):
    """The same state saved by save and by async_save: both load bitwise equal, every shard file
    is byte for byte the same (same checksum in both manifests), and so are the values."""
    a, b = str(tmp_path / "sync"), str(tmp_path / "async")
    assert run_on_ranks(_async_vs_sync, 2, a, b) == [([], []), ([], [])]
    sync, asyn = checkpoint.read_info(a), checkpoint.read_info(b)
    assert sync["values"] == asyn["values"] and sync["tensors"] == asyn["tensors"] and sync["plan"] == asyn["plan"]
    shards = sorted(f for f in sync["files"] if f != ".metadata")
    assert shards == ["rank_0/__0_0.distcp", "rank_1/__0_0.distcp"]
    assert {f: sync["files"][f] for f in shards} == {f: asyn["files"][f] for f in shards}
    assert not any(n.startswith(".partial-") for n in os.listdir(b))


def test_async_save_in_one_process_without_a_process_group(tmp_path):
    state = {"params": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}, "step": 5}
    pending = checkpoint.async_save(str(tmp_path), state)
    assert checkpoint.wait() == str(tmp_path / "step_00000005") == pending.result()
    assert checkpoint.read_info(str(tmp_path))["values"] == {"step": 5}
    template = {"params": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}, "step": 0}
    assert _same(_full(checkpoint.load(str(tmp_path), template)), _full(state)) == []


# ---- training goes on while the write runs ----------------------------------------------------


def _train_through_a_save(rank, world, root, n):
    model, plan, state = _setup(world, "zero3")
    straight = _full(_train(model, plan, state, 2 * n, rank, world))

    half = _train(model, plan, state, n, rank, world)
    # Rank 1's write is held until training is done: rank 0's background thread waits in the
    # commit's all-gather (its own group) while its training thread runs the step's collectives.
    with _held_write(rank_to_hold=1) as release:
        pending = checkpoint.async_save(root, half, plan)
        through = _train(model, plan, half, n, rank, world)
        running = not pending.done()
        release.set()
        committed = pending.result()
    _, plan2, template = _setup(world, "zero3", seed=1)
    resumed = _train(model, plan2, checkpoint.load(root, template, plan2), n, rank, world)
    return running, committed, _same(straight, _full(through)), _same(straight, _full(resumed))


def test_training_runs_while_the_write_runs_and_resume_is_bitwise(run_on_ranks, tmp_path):
    """N steps, async_save, N more steps while the save is still in flight (rank 1's write held
    back until then), then the commit: the run equals 2N straight steps, and so does loading the
    checkpoint into a fresh template and training N steps, bit for bit."""
    root = str(tmp_path / "ckpt")
    results = run_on_ranks(_train_through_a_save, 2, root, 2)
    for running, committed, through, resumed in results:
        assert running, "the save finished before training went on: nothing overlapped"
        assert committed == os.path.join(root, "step_00000002")
        assert through == [] and resumed == [], (through, resumed)


# ---- one save in flight at a time; errors reach every rank ---------------------------------------


def _second_save_waits(rank, world, root):
    model, plan, state = _setup(world, "zero3")
    with _held_write() as release:
        first = checkpoint.async_save(root, {**state, "step": 1}, plan)
        threading.Timer(1.0, release.set).start()
        second = checkpoint.async_save(root, {**state, "step": 2}, plan)  # waits for the first
        first_done_at_return = first.done()
    return first_done_at_return, first.result(), second.result(), checkpoint.wait()


def test_a_second_save_waits_for_the_first(run_on_ranks, tmp_path):
    root = str(tmp_path / "ckpt")
    for done, first, second, waited in run_on_ranks(_second_save_waits, 2, root):
        assert done and first.endswith("step_00000001") and second.endswith("step_00000002") and waited is None
    assert checkpoint.latest(root) == os.path.join(root, "step_00000002")
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000001", "step_00000002"]


def _no_space(self, plan, planner):
    raise OSError(28, "No space left on device")


def _failing_background_write(rank, world, root):
    """Step 1 saved; step 2's background write fails on rank 1. What each rank sees: the error
    raised by wait(), the error raised by the next async_save when nobody waited, and the save
    after those."""
    model, plan, state = _setup(world, "zero3")
    checkpoint.save(root, {**state, "step": 1}, plan)
    seen = []
    write_data = dcp.FileSystemWriter.write_data
    try:
        for how in ("wait", "next save"):
            if rank == 1:
                dcp.FileSystemWriter.write_data = _no_space
            checkpoint.async_save(root, {**state, "step": 2}, plan)
            _train(model, plan, state, 1, rank, world)  # training collectives meanwhile
            try:
                if how == "wait":
                    checkpoint.wait()
                else:
                    checkpoint.async_save(root, {**state, "step": 3}, plan)
                seen.append("nothing raised")
            except OSError as e:
                seen.append(str(e))
            dcp.FileSystemWriter.write_data = write_data
            seen.append(checkpoint.latest(root))
    finally:
        dcp.FileSystemWriter.write_data = write_data
    ok = checkpoint.async_save(root, {**state, "step": 4}, plan).result()
    return seen, ok, checkpoint.wait()


def test_a_background_write_error_reaches_every_rank(run_on_ranks, tmp_path):
    """Rank 1's disk is full during the background write: both ranks raise the OSError, naming
    rank 1 and the directory, at wait() or, if nothing waited, at the next async_save (which
    then saves nothing); the previous checkpoint stays the latest, and a later save works."""
    root = str(tmp_path / "ckpt")
    step1 = os.path.join(root, "step_00000001")
    for seen, ok, after in run_on_ranks(_failing_background_write, 2, root):
        for error in (seen[0], seen[2]):
            assert "No space left on device" in error and "on rank 1" in error and ".partial-step_00000002" in error, (
                seen
            )
        assert seen[1] == seen[3] == step1
        assert ok == os.path.join(root, "step_00000004") and after is None
    assert checkpoint.read_info(root)["values"]["step"] == 4


class _NoHostMemory:
    def stage(self, state_dict):
        raise RuntimeError("cannot allocate the host copy")


def _staging_fails_on_rank_1(rank, world, root):
    from fsdpfn.checkpoint import _async

    model, plan, state = _setup(world, "zero3")
    checkpoint.save(root, {**state, "step": 1}, plan)
    stager = _async._stager
    if rank == 1:
        _async._stager = _NoHostMemory
    try:
        checkpoint.async_save(root, {**state, "step": 2}, plan)
    finally:
        _async._stager = stager
    try:
        checkpoint.wait()
        return "nothing raised", checkpoint.latest(root)
    except RuntimeError as e:
        return str(e), checkpoint.latest(root)


def test_a_staging_error_on_one_rank_reaches_every_rank(run_on_ranks, tmp_path):
    """Rank 1 cannot make its host copy: its async_save still returns, and both ranks raise the
    error at wait(), naming rank 1; nothing is published."""
    root = str(tmp_path / "ckpt")
    for error, latest in run_on_ranks(_staging_fails_on_rank_1, 2, root):
        assert "cannot allocate the host copy" in error and "on rank 1" in error, error
        assert latest == os.path.join(root, "step_00000001")


def _scoped_elsewhere(seen):
    from fsdpfn import comm

    seen.append(comm.timeout())
    with comm.timeout_scope(3):
        seen.append(comm.timeout())


def test_timeout_scopes_are_per_thread():
    """The background commit keeps its own timeout: a scope on one thread is not seen by another."""
    from fsdpfn import comm

    outside = comm.timeout()
    seen: list[float] = []
    with comm.timeout_scope(7):
        t = threading.Thread(target=_scoped_elsewhere, args=(seen,))
        t.start()
        t.join()
        assert comm.timeout() == 7.0
    assert seen == [outside, 3.0] and comm.timeout() == outside


# ---- a rank killed during the background write ------------------------------------------------


def _async_kill_worker(rank, world, init_file, root, die_at):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    model, plan, state = _setup(world, "zero3")
    state = {**state, "step": 1}
    checkpoint.async_save(root, state, plan).result()  # the previous, complete checkpoint
    moved = {**state, "params": {n: p + 1 for n, p in state["params"].items()}, "step": 2}
    stage, dying = die_at.split(":")
    if rank == int(dying):
        _die_at(stage, rank)  # on the background thread: the write, or the rename that publishes
    checkpoint.async_save(root, moved, plan)
    _train(model, plan, state, 3, rank, world)  # training goes on until the dead rank stops it
    checkpoint.wait()
    os._exit(3)  # not reached by the dying rank; survivors should have raised before this


def _spawn_and_kill_async(root, die_at, world=2):
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    init_file = os.path.join(tempfile.mkdtemp(prefix="fsdpfn_kill_async_"), "store")
    procs = [ctx.Process(target=_async_kill_worker, args=(r, world, init_file, root, die_at)) for r in range(world)]
    for p in procs:
        p.start()
    procs[int(die_at.split(":")[1])].join(timeout=180)
    for p in procs:  # the survivors are stuck in (or failing out of) a collective: end them
        p.join(timeout=15)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


@pytest.mark.e2e
@pytest.mark.parametrize("die_at", ["write:1", "commit:0"])
def test_rank_killed_during_the_background_write_leaves_the_previous_checkpoint(run_on_ranks, tmp_path, die_at):
    """A rank's process dies on the background thread ("write:1": rank 1 once its shards are
    written; "commit:0": rank 0 at the rename that would publish) while training runs. Step 1
    stays the latest and loads bitwise in a fresh group; the next save cleans up the debris."""
    root = str(tmp_path / "ckpt")
    codes = _spawn_and_kill_async(root, die_at)
    assert codes[int(die_at.split(":")[1])] == 137, codes
    assert checkpoint.read_info(root)["values"]["step"] == 1
    assert any(n.startswith(".partial-step_00000002") for n in os.listdir(root))
    assert all(run_on_ranks(_load_step1, 2, root))
    assert checkpoint.read_info(root)["values"]["step"] == 3
    assert not any(n.startswith(".partial-") for n in os.listdir(root))


@pytest.mark.e2e
def test_benchmark_quick_run_prints_both_stalls_and_the_ratio():
    import re
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "checkpoint.py")
    proc = subprocess.run(
        [sys.executable, script, "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"^\s+save: stall per save \d+\.\d+ s", proc.stdout, re.M), proc.stdout
    assert re.search(r"^async_save: stall per save \d+\.\d+ s .* commit \d+\.\d+ s after the call", proc.stdout, re.M)
    assert re.search(r"^async/sync stall ratio: \d+\.\d+$", proc.stdout, re.M), proc.stdout
