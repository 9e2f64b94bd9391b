"""The communication layer: it sees every distributed call, names stuck ranks, has one timeout.

- A whole training step (shard with its rank check, runtime forward/backward, Muon's owner
  all-to-alls, the global-norm all-reduce, a checkpoint save and load) counts exactly the calls
  and bytes that a wrapper around ``torch.distributed`` sees, and DTensor issues none behind it.
- A rank that skips a collective is named as behind within the timeout, on every rank that waits.
- ``full_tensor`` and the object collectives equal torch's own on uneven and HSDP shards.
- Timeouts are validated and scoped; spawned ranks die with their launcher; unpicklable
  functions are refused before anything starts.
"""

import collections
import functools
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdpfn
from fsdpfn import comm, optim, testing
from fsdpfn.launch import RankError, launch
from fsdpfn.models import GPT, GPTConfig

# ---- the counter sees everything ------------------------------------------------------------

_TENSOR_CALLS = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
    "monitored_barrier",
    "all_to_all",
)
_OBJECT_CALLS = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class _Spy:
    """Wraps every collective of ``torch.distributed``: calls and the larger buffer's bytes."""

    def __init__(self):
        self.calls, self.nbytes, self.names, self._saved = 0, 0, [], {}

    def __enter__(self):
        for name in _TENSOR_CALLS + _OBJECT_CALLS:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, (torch.Tensor, list, tuple))]
                self.calls += 1
                self.nbytes += max((_nbytes(t) for t in tensors), default=0)
                self.names.append(_name)
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _whole_step(rank, world, tmp):
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, width=16, depth=2, heads=2, seq_len=8, bias=False))
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    rt = fsdpfn.runtime.Runtime(model, plan, prefetch=1)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.muon(lr=0.02, layout="owner"))
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))

    def loss_fn(ps):
        return F.cross_entropy(rt.apply(ps, x).flatten(0, 1), x.flatten())

    # CommDebugMode (which sees DTensor's own collectives) cannot run under torch.func.grad.
    with _Spy() as spy, comm.count_collectives() as counter:
        with CommDebugMode() as before:
            params = fsdpfn.shard(model, plan)
            state = opt.init(params)
        grads, _ = rt.value_and_grad(loss_fn)(params)
        with CommDebugMode() as after:
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
            fsdpfn.checkpoint.save(tmp, {"params": params, "step": 1}, plan)
            loaded = fsdpfn.checkpoint.load(tmp, {"params": params, "step": 0}, plan)
    same = all(torch.equal(loaded["params"][n].to_local(), params[n].to_local()) for n in params)
    ours = counter.calls
    return {
        "spy": (spy.calls, spy.nbytes),
        "ours": (len(ours), sum(c.nbytes for c in ours)),
        "kinds": sorted(counter.counts()),
        "spy_names": sorted(set(spy.names)),
        # DTensor's redistributions go through the functional collectives; ours through c10d.
        "dtensor": sum(v for m in (before, after) for k, v in m.get_comm_counts().items() if "functional" in str(k)),
        "loaded": same,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_counter_sees_every_distributed_call_of_a_training_step(run_on_ranks, tmp_path, world):
    for r in run_on_ranks(_whole_step, world, str(tmp_path / "ckpt")):
        assert r["spy"] == r["ours"], r["spy_names"]
        assert r["dtensor"] == 0, "a DTensor op issued a collective behind the counter's back"
        assert {"all_gather", "reduce_scatter", "all_to_all", "all_reduce"} <= set(r["kinds"]), r["kinds"]
        assert r["loaded"]


# ---- stuck ranks are named --------------------------------------------------------------------


def _skip_one(rank, world, skipper, seconds):
    with comm.timeout_scope(seconds):
        comm.barrier(tag="warm-up")
        if rank == skipper:
            return ("skipped", None, 0.0)
        t = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4), tag="blocks.1")
        except comm.CollectiveError as e:
            return ("error", str(e), time.monotonic() - t, e.behind)
        return ("ok", None, time.monotonic() - t)


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_never_arrives_is_named_within_the_timeout(run_on_ranks, world):
    skipper = world - 1
    results = run_on_ranks(_skip_one, world, skipper, 2.0)
    for rank, r in enumerate(results):
        if rank == skipper:
            continue
        kind, message, waited, behind = r
        assert kind == "error"
        assert waited < 2.0 + 3.0, waited
        assert behind == [skipper], message
        assert f"rank {skipper}: last started #" in message and "1 collective(s) behind" in message, message
        assert "all_reduce of 'blocks.1'" in message and f"failed on rank {rank}" in message, message
        assert "FSDPFN_TIMEOUT" in message


class _CountingStore:
    """Passes every call to the real store and counts it by method name."""

    def __init__(self, store):
        self._store, self.ops = store, collections.Counter()

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.ops[name] += 1
            return attr(*args, **kwargs)

        return call


def _store_ops(rank, world, n):
    from fsdpfn.comm import _groups

    counting = _CountingStore(_groups.store())
    real, _groups.store = _groups.store, lambda: counting
    try:
        comm.barrier(tag="warm-up")
        counting.ops.clear()
        x, rows = torch.ones(6), torch.arange(6.0)
        for _ in range(n):
            comm.all_reduce(x, tag="hot")
            comm.all_gather(torch.empty(6 * world), rows)
            comm.reduce_scatter(torch.empty(6), torch.ones(6 * world))
            comm.all_to_all(torch.empty(6 * world), torch.ones(6 * world))
            comm.broadcast(x, src=0)
            comm.barrier()
        hot = dict(counting.ops)
        records = comm.flight_records()
        # A wait longer than a second looks at the alarm once a second: the same wrapper sees it.
        if rank == 1:
            time.sleep(1.6)
        comm.barrier(tag="slow peer")
        slow = dict(counting.ops)
    finally:
        _groups.store = real
    return hot, slow, [(r.seq, r.kind, r.tag) for r in records]


def test_collectives_touch_the_store_only_when_a_wait_is_long(run_on_ranks):
    n = 50  # 6 collectives each: 300 collectives
    for rank, (hot, slow, records) in enumerate(run_on_ranks(_store_ops, 2, n)):
        assert hot == {}, f"rank {rank}: store calls during {6 * n} collectives: {hot}"
        # The ring buffer holds the last 32, numbered on their group (the same on every rank).
        assert len(records) == 32 and records[-1][1:] == ("barrier", "")
        assert [s for s, _, _ in records] == list(range(records[0][0], records[0][0] + 32))
        if rank == 0:  # it waited ~1.6 s for rank 1: one look at the alarm, which had not gone off
            assert slow == {"add": 1}, slow


def _remote_peers(rank, world):
    """Every rank pretends to be on its own host, so no peer's file can be read: rank 0 times out
    on the world group and must learn where the others are from their answers in the store.
    Rank 1 waits in a collective of another group (it answers the alarm), rank 2 computes."""
    from fsdpfn.comm import _record

    real_me = _record._me
    _record._me = lambda: {**real_me(), "host": f"host{rank}"}
    _record._flight["identified"] = None
    _record.identify()
    pair = dist.new_group([1, 2])
    try:
        comm.barrier(tag="warm-up")
        t = time.monotonic()
        if rank == 0:
            with comm.timeout_scope(2.0):
                try:
                    comm.all_reduce(torch.ones(2), tag="world")
                except comm.CollectiveError as e:
                    return str(e), e.behind, time.monotonic() - t
        elif rank == 1:
            with comm.timeout_scope(9.0):
                try:
                    comm.all_reduce(torch.ones(2), pair, tag="pair")
                except comm.CollectiveError:
                    pass
        else:
            time.sleep(9.0)
        return None, None, time.monotonic() - t
    finally:
        _record._me = real_me


def test_peers_on_other_hosts_answer_through_the_store(run_on_ranks):
    message, behind, waited = run_on_ranks(_remote_peers, 3)[0]
    # Rank 1 answered from its wait (it looks at the alarm once a second); rank 2 never did, so
    # rank 0 waited the whole answer window: 2 s timeout + 2.5 s, plus slack for 2 busy cores.
    assert behind == [1, 2], message
    assert 2.0 + 2.5 <= waited < 2.0 + 2.5 + 4.0, waited
    assert re.search(
        r"rank 1: last started #\d+ barrier of 'warm-up' \d+\.\d s ago, 1 collective\(s\) behind; "
        r"then #\d+ all_reduce of 'pair' on another group",
        message,
    ), message
    assert "rank 2: no answer within 2.5 s (busy outside collectives, stopped or dead; host host2" in message, message


def _pool_is_fresh(rank, world):
    return comm.healthy(), comm.flight_records()[-1:] == [] or True


def test_the_pool_is_replaced_after_a_failed_collective(run_on_ranks):
    run_on_ranks(_skip_one, 2, 1, 1.0)
    assert [ok for ok, _ in run_on_ranks(_pool_is_fresh, 2)] == [True, True]


def test_timeouts_are_validated_and_scoped(monkeypatch):
    monkeypatch.delenv("FSDPFN_TIMEOUT", raising=False)
    assert comm.timeout() == comm.DEFAULT_TIMEOUT
    monkeypatch.setenv("FSDPFN_TIMEOUT", "7")
    assert comm.timeout() == 7.0
    with comm.timeout_scope(3):
        assert comm.timeout() == 3.0
        with comm.timeout_scope(1.5):
            assert comm.timeout() == 1.5
        assert comm.timeout() == 3.0
    assert comm.timeout() == 7.0
    comm.set_timeout(9)
    try:
        assert comm.timeout() == 9.0
    finally:
        comm.set_timeout(None)
    for bad in (0, -1, float("nan"), "soon"):
        with pytest.raises(ValueError, match="positive number of seconds"):
            comm.set_timeout(bad)
    monkeypatch.setenv("FSDPFN_TIMEOUT", "zero")
    with pytest.raises(ValueError, match="FSDPFN_TIMEOUT"):
        comm.timeout()


# ---- DTensor and object collectives ----------------------------------------------------------


def _full_tensor(rank, world, mesh_shape, rows):
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = testing.mesh(mesh_shape, names)
    torch.manual_seed(0)
    full = torch.randn(rows, 3)
    placements = [torch.distributed.tensor.Replicate()] * (mesh.ndim - 1) + [torch.distributed.tensor.Shard(0)]
    x = torch.distributed.tensor.distribute_tensor(full, mesh, placements)
    with comm.count_collectives() as counter:
        ours = comm.full_tensor(x)
    objs = comm.all_gather_object({"rank": rank, "payload": "x" * rank})
    told = comm.broadcast_object(["from", rank], src=world - 1)
    return torch.equal(ours, full), counter.counts(), objs, told


@pytest.mark.parametrize("mesh_shape,rows", [((3,), 5), ((3,), 2), ((2, 2), 5), ((2,), 0)])
def test_full_tensor_and_object_collectives(run_on_ranks, mesh_shape, rows):
    world = 1
    for d in mesh_shape:
        world *= d
    for equal, counts, objs, told in run_on_ranks(_full_tensor, world, mesh_shape, rows):
        assert equal
        assert counts == {"all_gather": 1}
        assert objs == [{"rank": r, "payload": "x" * r} for r in range(world)]
        assert told == ["from", world - 1]


def test_reduce_scatter_impl_scope_and_deprecated_setter():
    assert comm.reduce_scatter(torch.empty(2), torch.ones(2), impl="native").wait().tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="'auto', 'native' or 'all_to_all'"):
        with comm.reduce_scatter_impl("ring"):
            pass
    with pytest.warns(DeprecationWarning, match="reduce_scatter_impl"):
        comm.set_reduce_scatter_impl("auto")


# ---- launching ---------------------------------------------------------------------------------


def test_unpicklable_functions_are_refused_before_any_rank_starts():
    t = time.monotonic()
    with pytest.raises(ValueError, match="picklable.*module-level function"):
        testing.run_on_ranks(lambda rank, world: rank, 2)
    with pytest.raises(ValueError, match="argument 0 must be picklable"):
        testing.run_on_ranks(_skip_one, 2, (x for x in range(2)))
    with pytest.raises(ValueError, match="launch\\(main\\)"):
        launch(lambda rank, world: rank, 2)
    assert time.monotonic() - t < 5.0


def _returns_rank(rank, world, scale):
    return rank * scale


def _dies_on_one(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.barrier(tag="after the death")


@pytest.mark.e2e
def test_launch_returns_results_and_names_a_killed_rank():
    assert launch(_returns_rank, 2, 10) == [0, 10]
    t = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_dies_on_one, 2, timeout=5)
    message = str(info.value)
    assert time.monotonic() - t < 30
    assert "rank 1" in message and "killed by signal 9" in message, message
    assert 1 in info.value.errors


_ORPHAN_SCRIPT = """
import os, sys, time
sys.path.insert(0, {root!r})
from fsdpfn.launch import launch

def main(rank, world, pid_dir):
    open(os.path.join(pid_dir, str(rank)), "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    launch(main, 2, sys.argv[1])
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_die_with_their_launcher(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(fsdpfn.__file__)))
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_ORPHAN_SCRIPT.format(root=root)))
    pids = tmp_path / "pids"
    pids.mkdir()
    # The launcher ignores SIGINT (as a wrapper script might) and is then killed outright.
    job = subprocess.Popen(
        [sys.executable, str(script), str(pids)],
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.monotonic() + 60
    while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = [int((pids / f).read_text()) for f in os.listdir(pids)]
    assert len(ranks) == 2
    job.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert job.poll() is None and all(_alive(p) for p in ranks)
    job.kill()
    job.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks), "a rank outlived its launcher"


@pytest.mark.e2e
def test_a_function_from_a_main_without_a_file_is_refused_with_the_reason():
    code = (
        "import fsdpfn.testing as t\n"
        "def f(rank, world):\n    return rank\n"
        "try:\n    t.run_on_ranks(f, 2)\nexcept ValueError as e:\n    print('REFUSED', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in proc.stdout and "defined in __main__ without a file" in proc.stdout, proc.stdout + proc.stderr


def _groups_of_some_ranks(rank, world):
    # A pipeline of 4 stages makes a group of its last stage's rank alone, then one of 2 stages
    # a group of ranks 2 and 3: made by their members alone, the second hung in gloo's
    # rendezvous on rank 2 and 3. Every rank makes each, in the same order.
    alone = comm.ranks_group([3])
    pair = comm.ranks_group([2, 3])
    assert comm.ranks_group([3, 2]) is pair  # kept, whatever the order of the ranks given
    t = torch.tensor([float(rank)])
    if rank in (2, 3):
        with comm.timeout_scope(30):
            comm.all_reduce(t, group=pair).wait()
    if rank == 3:
        comm.all_reduce(torch.ones(1), group=alone).wait()
    return t.item()


def test_groups_of_some_ranks_are_made_by_every_rank_in_order(run_on_ranks):
    assert run_on_ranks(_groups_of_some_ranks, 4, timeout=60) == [0.0, 1.0, 5.0, 5.0]


def _recv_from_a_failing_peer(rank, world, when):
    """Rank 1 raises instead of sending (``when="before"``), or after a first message it sent
    (``"after"``); rank 0 waits in a point-to-point receive from it. Rank 1's process lives on (a
    persistent worker, a user's loop that catches and logs), so its connection stays open."""
    comm.barrier(tag="warm-up")
    if rank == 1:
        if when == "after":
            comm.pp_send(torch.ones(3), peer=0).wait()
        raise ValueError("bad batch on rank 1")
    if when == "after":
        assert torch.equal(comm.pp_recv(torch.empty(3), peer=1).wait(), torch.ones(3))
    comm.pp_recv(torch.empty(3), peer=1, tag="stage 1 grads").wait()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_point_to_point_wait_ends_when_its_peer_announces_a_failure(run_on_ranks, when):
    """A rank waiting for a message from a peer that raised (and announced it) fails within about
    a second naming the peer's error, as a collective does: not at the process group's timeout
    (the pool's is 180 s; the caller waits 5 s for the others once one rank failed, so a wait
    that missed the announcement reports rank 0 as not finished)."""
    with pytest.raises(RankError) as info:
        run_on_ranks(_recv_from_a_failing_peer, 2, when)
    errors = info.value.errors
    assert "ValueError: bad batch on rank 1" in errors[1], errors[1]
    assert "CollectiveError" in errors[0] and "failed on rank 0" in errors[0], errors[0]
    assert "'stage 1 grads'" in errors[0], errors[0]
    assert "Rank 1 raised: ValueError: bad batch on rank 1" in errors[0], errors[0]
