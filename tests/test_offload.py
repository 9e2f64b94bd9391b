"""CPU offload per unit (``fsdpfn.plan(..., offload=...)``) in the runtime: an offloaded unit's
shards, gradients and optimizer state stay in host memory; the schedule copies the shards in
before each gather and the gradients out after their reduce. Copies are exact, so every step is
bitwise the run without offload; between steps the unit holds no device bytes (counted); the
copies and their bytes are those the schedule lists. On a CPU-only machine the device is the CPU
and the copies go between two host buffers: the same path runs."""

from __future__ import annotations

import dataclasses
import functools

import optree
import pytest
import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import Op, Runtime, ScheduleError, schedule, validate

CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=3, heads=4)
PER_RANK = 2


def _train(rank, world, strategy, style, offload, steps=5, streamed=False):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=strategy, offload=offload)
    rt = Runtime(model, plan)
    params = fsdpfn.shard(model, plan, requires_grad=(style == "eager"))
    opt = fsdpfn.optim.adamw(lr=1e-3)
    if streamed:  # the step runs on the "device" (the CPU here) and the state is written back to host buffers
        opt = fsdpfn.optim.streamed(opt, device="cpu")
    state = opt.init(params)
    state_buffers = [
        t._local_tensor.untyped_storage()._cdata for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor)
    ]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    copies, between = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, CFG.vocab_size, (world * PER_RANK, CFG.seq_len + 1), generator=gen)
        x, y = tokens[mine, :-1], tokens[mine, 1:]
        if style == "func":
            g, _ = rt.value_and_grad(lambda ps: F.cross_entropy(rt.apply(ps, x).flatten(0, 1), y.flatten()))(params)
        else:
            with rt.bind(params):
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            g = rt.grads(params)
        copies.append(list(rt.last_step.copies))
        between.append(dict(rt.memory.offloaded))
        updates, state = opt.update(g, state, params)  # on the host, where an offloaded unit's state lives
        params = fsdpfn.optim.apply_updates(params, updates)
        params = {n: p.detach().requires_grad_(style == "eager") for n, p in params.items()}
    devices = {str(t._local_tensor.device) for t in [*params.values(), *g.values()]}
    same = [
        t._local_tensor.untyped_storage()._cdata for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor)
    ] == state_buffers
    assert same or not streamed, "streamed must write the new state into the host state's buffers"
    return {n: p._local_tensor for n, p in params.items()}, copies, between, devices, plan


@functools.cache
def _plain(strategy, style):
    return testing.run_on_ranks(_train, 2, strategy, style, None)


@pytest.mark.parametrize("style", ["func", "eager"])
@pytest.mark.parametrize("strategy", ["replicate", "zero1", "zero2", "zero3"])
def test_offload_is_bitwise_the_run_without_it(run_on_ranks, strategy, style):
    got = run_on_ranks(_train, 2, strategy, style, True)
    for (p0, *_), (p1, copies, between, devices, plan) in zip(_plain(strategy, style), got):
        assert all(torch.equal(p0[n], p1[n]) for n in p0), [n for n in p0 if not torch.equal(p0[n], p1[n])]
        assert between == [{}] * 5  # nothing of an offloaded unit stays on the device between steps
        assert devices == {"cpu"}
        # One copy in per gather, one copy out per unit: the shard bytes each way.
        sched = schedule(plan)
        shard_bytes = {u.name: sum(p1[p.name].numel() * 4 for p in u.params) for u in plan.units}
        expected = [
            ("copy_in" if op.kind.value == "copy_in" else "copy_out", op.unit, shard_bytes[op.unit])
            for op in sched.ops
            if op.kind.value in ("copy_in", "copy_out")
        ]
        gathers = [op.unit for op in sched.ops if op.kind.value == "gather"]
        assert [c[1] for c in expected if c[0] == "copy_in"] == gathers
        assert all(c == expected for c in copies), [(a, b) for a, b in zip(copies[0], expected) if a != b]


@pytest.mark.parametrize("style", ["func", "eager"])
def test_the_streamed_optimizer_step_is_bitwise_the_host_step(run_on_ranks, style):
    host = run_on_ranks(_train, 2, "zero3", style, True)
    streamed = run_on_ranks(_train, 2, "zero3", style, True, 5, True)
    for (p0, *_), (p1, *_) in zip(host, streamed):
        assert all(torch.equal(p0[n], p1[n]) for n in p0)


def test_offload_per_unit_and_in_the_plan_json():
    plan = fsdpfn.plan(GPT(CFG), (2,), offload={"blocks.*": True})
    assert [u.offload for u in plan.units] == [False, True, True, True]
    again = fsdpfn.Plan.from_json(plan.to_json())
    assert again == plan and again.fingerprint == plan.fingerprint
    assert fsdpfn.plan(GPT(CFG), (2,)).to_dict()["format"] == 1  # plans without it keep their old form
    with pytest.raises(ValueError, match="offload pattern 'layers.*' matches no unit"):
        fsdpfn.plan(GPT(CFG), (2,), offload={"layers.*": True})
    with pytest.raises(ValueError, match="offload must be True, False"):
        fsdpfn.plan(GPT(CFG), (2,), offload="yes")


def test_the_validator_checks_the_copies():
    plan = fsdpfn.plan(GPT(CFG), (2,), offload={"blocks.1": True})
    s = schedule(plan)
    validate(s, plan)
    ops = list(s.ops)
    first_copy = ops.index(Op("copy_in", "blocks.1"))
    with pytest.raises(ScheduleError, match="add 'copy_in blocks.1' before this gather"):
        validate(dataclasses.replace(s, ops=ops[:first_copy] + ops[first_copy + 1 :]), plan)
    out = ops.index(Op("copy_out", "blocks.1"))
    with pytest.raises(ScheduleError, match="'copy_out blocks.1' is missing"):
        validate(dataclasses.replace(s, ops=ops[:out] + ops[out + 1 :]), plan)
    with pytest.raises(ScheduleError, match="before 'wait_reduce blocks.1'"):
        validate(dataclasses.replace(s, ops=[*ops[:first_copy], Op("copy_out", "blocks.1"), *ops[first_copy:]]), plan)
    with pytest.raises(ScheduleError, match="unit 'blocks.0' is not offloaded"):
        validate(dataclasses.replace(s, ops=[Op("copy_in", "blocks.0"), *ops]), plan)


def _sim_vs_run(rank, world, strategy):
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=strategy, offload={"blocks.*": True})
    rt = Runtime(model, plan)
    params = fsdpfn.shard(model, plan, requires_grad=True)
    x = torch.randint(0, CFG.vocab_size, (PER_RANK, CFG.seq_len))
    with rt.bind(params):
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    counted = {"copy_in": 0, "copy_out": 0}
    for kind, _, nbytes in rt.last_step.copies:
        counted[kind] += nbytes
    wl = fsdpfn.sim.profile(model, plan, x)
    res = fsdpfn.sim.simulate(plan, rt.schedule, wl, fsdpfn.sim.AdamW(), fsdpfn.sim.H100_SXM)
    plain = fsdpfn.sim.simulate(
        fsdpfn.plan(model, (world,), strategy=strategy), None, wl, fsdpfn.sim.AdamW(), fsdpfn.sim.H100_SXM
    )
    streamed = fsdpfn.sim.simulate(plan, rt.schedule, wl, fsdpfn.sim.AdamW(streamed=True), fsdpfn.sim.H100_SXM)
    return counted, res.host_copies, res.memory, plain.memory, res.step_time, plain.step_time, streamed.host_copies


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_simulator_costs_offload_as_it_runs(run_on_ranks, strategy):
    """The simulator's host-device bytes per step are the runtime's counts; the offloaded units'
    shards, gradients and optimizer state leave the device (reported as host memory); the step
    pays for the copies and the host optimizer."""
    (counted, predicted, mem, plain, t, t_plain, streamed), _ = run_on_ranks(_sim_vs_run, 2, strategy)
    assert predicted == counted and counted["copy_in"] > 0, (predicted, counted)
    # streamed AdamW: parameters, gradients and two state slots in; two slots and the updates out
    shards = mem["host"] // (2 + 2)  # host: params + grads (sharded here) + two fp32 slots, all shard-sized
    assert (streamed["stream_in"], streamed["stream_out"]) == (4 * shards, 3 * shards), streamed
    device = lambda m: m["params"] + m["grads"] + m["optimizer_state"]  # noqa: E731
    assert device(mem) + mem["host"] == device(plain) and mem["host"] > 0
    assert t > t_plain
