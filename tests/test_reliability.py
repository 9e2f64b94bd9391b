"""Reliability: no silent wrong numbers from the transforms, devices respected everywhere.

(Timeouts and stuck ranks: tests/test_comm.py and tests/test_faults.py; optimizer settings and
non-finite steps: tests/test_optim_reliability.py; checkpoints: tests/test_checkpoint_faults.py.)
"""

import time

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn.launch import RankError
from fsdpfn.models import GPT, GPTConfig


class _Tall(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 10, bias=False)])

    def forward(self, x):
        return self.layers[0](x)


def _wrong_split(rank, world):
    torch.manual_seed(0)
    model = _Tall()
    mesh = testing.mesh((world,))
    plan = fsdpfn.plan(model, mesh, strategy="zero3")
    w = model.layers[0].weight.detach()
    # Right global shape, wrong rows: tensor_split gives 4, 3, 3 where torch.chunk gives 4, 4, 2.
    local = torch.tensor_split(w, world)[rank].clone()
    params = {
        "layers.0.weight": DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride()
        )
    }
    fsdpfn.unshard(params, plan)


def test_shards_cut_with_another_split_are_refused_on_every_rank(run_on_ranks):
    # Ranks 1 and 2 see the wrong rows themselves; rank 0's 4 rows agree with torch.chunk. The
    # ranks agree on the check before the gather, so rank 0 raises the same ValueError, naming
    # the parameter and both ranks, instead of waiting in an all-gather its peers never start.
    t = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_wrong_split, 3)
    assert time.monotonic() - t < 90  # pool start-up on busy cores included; the 180 s harness timeout is far
    errors = info.value.errors
    assert sorted(errors) == [0, 1, 2]
    for rank in (0, 1, 2):
        assert "ValueError: rank(s) [1, 2] refused the input of 'layers.0'" in errors[rank], errors[rank]
        assert "CollectiveError" not in errors[rank], errors[rank]
        for bad in (1, 2):
            assert f"params['layers.0.weight'] on shard rank {bad} has local shape" in errors[rank], errors[rank]
            assert "torch.chunk" in errors[rank]


def _wrong_rows_on_one_rank(rank, world):
    """Rank 1's shard has one row too many (6 of the 10 rows, where torch.chunk gives each of 2
    ranks 5); rank 0's is right. Returns each rank's error, the collectives it ran and its health."""
    torch.manual_seed(0)
    model = _Tall()
    mesh = testing.mesh((world,))
    plan = fsdpfn.plan(model, mesh, strategy="zero3")
    w = model.layers[0].weight.detach()
    rows = torch.chunk(w, world)[rank].clone()
    if rank == 1:
        rows = torch.cat([rows, rows[:1]])
    params = {
        "layers.0.weight": DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride())
    }
    with fsdpfn.comm.count_collectives() as counter:
        try:
            fsdpfn.unshard(params, plan)
        except ValueError as e:
            return str(e), counter.counts(), fsdpfn.comm.healthy()
    return None, counter.counts(), fsdpfn.comm.healthy()


def test_wrong_rows_on_one_rank_are_a_value_error_on_every_rank_before_the_gather(run_on_ranks):
    for rank, (error, counts, healthy) in enumerate(run_on_ranks(_wrong_rows_on_one_rank, 2)):
        assert error is not None and "rank(s) [1] refused the input of 'layers.0'" in error, (rank, error)
        assert "params['layers.0.weight'] on shard rank 1 has local shape (6, 3)" in error, error
        assert counts == {} and healthy, (rank, counts)  # no collective started; the groups stay usable


def _right_rows_twice(rank, world):
    """Right shards, gathered twice: the agreement runs once per unit (through the store), the
    gathers are the only collectives, and the result is the full weight."""
    torch.manual_seed(0)
    model = _Tall()
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params = fsdpfn.shard(model, plan)
    out = []
    for _ in range(2):
        with fsdpfn.comm.count_collectives() as counter:
            full = fsdpfn.unshard(params, plan)["layers.0.weight"]
        out.append((torch.equal(full, model.layers[0].weight.detach()), counter.counts()))
    return out


def test_the_agreement_adds_no_collective(run_on_ranks):
    for per_gather in run_on_ranks(_right_rows_twice, 2):
        assert per_gather == [(True, {"all_gather": 1})] * 2, per_gather


def _default_device_is_not_used(rank, world):
    """Every buffer lives on the device of the tensors it serves: with the default device set to
    'meta', any buffer allocated on the default device would be a meta tensor and break the step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, width=16, depth=2, heads=2, seq_len=8, bias=False))
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy={"*": "zero3", "<root>": "zero2"})
    params = fsdpfn.shard(model, plan)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.muon(lr=0.02, layout="owner"))
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
    rt = fsdpfn.runtime.Runtime(model, plan)

    def loss_fn(ps, pure):
        out = torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)) if pure else rt.apply(ps, x)
        return F.cross_entropy(out.flatten(0, 1), x.flatten())

    results = []
    state = opt.init(params)
    with torch.device("meta"):
        for pure in (True, False):
            grads = torch.func.grad(loss_fn)(params, pure)
            updates, _ = opt.update(grads, state, params)
            new = optim.apply_updates(params, updates)
            results.append(
                {
                    n: (g.device.type, u.device.type, p.to_local().device.type)
                    for (n, g), u, p in zip(grads.items(), updates.values(), new.values())
                }
            )
    return results


def test_no_buffer_lands_on_the_default_device(run_on_ranks):
    for per_path in run_on_ranks(_default_device_is_not_used, 2):
        for devices in per_path:
            assert set(devices.values()) == {("cpu", "cpu", "cpu")}, devices


def test_sharding_a_meta_model_is_a_named_error_even_unchecked():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=16, width=8, depth=1, heads=2, seq_len=4))
    plan = fsdpfn.plan(model, (2,))
    with pytest.raises(ValueError, match="meta device.*fsdpfn.init_shards"):
        fsdpfn.shard(model, plan, check=False)
