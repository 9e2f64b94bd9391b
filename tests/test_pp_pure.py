"""The pure GPipe path: ``torch.func.grad`` of a loss pipelined over 2 gloo ranks, each rank
holding one stage (sharded with its stage's plan), equals one process's gradients."""

import time

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=37, seq_len=8, width=20, depth=4, heads=2)
UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
MICRO, BATCH = 4, 2


def _sub(full, prefix):
    return {k[len(prefix) + 1 :]: v for k, v in full.items() if k.startswith(prefix + ".")}


def _stage0(model, full, tokens):
    x = F.embedding(tokens, full["embed.weight"]) + F.embedding(torch.arange(tokens.shape[1]), full["pos.weight"])
    for i in (0, 1):
        x = functional_call(model.blocks[i], _sub(full, f"blocks.{i}"), (x,))
    return x


def _stage1(model, full, x):
    for i in (2, 3):
        x = functional_call(model.blocks[i], _sub(full, f"blocks.{i}"), (x,))
    return functional_call(model.head, _sub(full, "head"), (functional_call(model.norm, _sub(full, "norm"), (x,)),))


def _data():
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, CFG.vocab_size, (MICRO, BATCH, CFG.seq_len), generator=g)
    return xs, torch.roll(xs, -1, dims=-1)


def _reference():
    torch.manual_seed(0)
    model = GPT(CFG)
    xs, ys = _data()

    def loss(p):  # the mean over micro-batches of each one's mean: the whole batch's mean
        return (
            sum(F.cross_entropy(functional_call(model, p, (x,)).flatten(0, 1), y.flatten()) for x, y in zip(xs, ys))
            / MICRO
        )

    params = dict(model.named_parameters())
    return loss(params).item(), torch.func.grad(loss)(params)


def _gpipe(rank, world):
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = testing.mesh((2, 1), ("pp", "dp"))
    plan = fsdpfn.pipeline_plan(model, mesh, units=UNITS)
    stage = plan.stage_plan(rank)  # one stage per rank: stage r on pp rank r
    params = fsdpfn.shard({n: p for n, p in model.named_parameters() if n in stage.param_names}, stage)
    group = mesh.get_group("pp")
    xs, ys = _data()
    act = (BATCH, CFG.seq_len, CFG.width)

    def pipelined_loss(ps):
        full = fsdpfn.unshard(ps, stage)
        # a zero-element view of a parameter: what a rank that receives sends, so the hop is in
        # its graph and its backward (the collective the sender waits in) runs
        nothing = next(iter(full.values())).reshape(-1)[:0]
        total = nothing.sum()
        for x, y in zip(xs, ys):  # GPipe: every micro-batch forward, then autograd runs them back
            if rank == 0:
                total = total + fsdpfn.comm.pp_send_recv(_stage0(model, full, x), (0,), group).sum()
            else:
                h = fsdpfn.comm.pp_send_recv(nothing, act, group)
                total = total + F.cross_entropy(_stage1(model, full, h).flatten(0, 1), y.flatten()) / MICRO
        return total

    with fsdpfn.comm.timeout_scope(60):
        grads, loss = torch.func.grad_and_value(pipelined_loss)(params)
    ref_loss, ref = _reference()
    errs = {n: ((g.full_tensor() - ref[n]).norm() / ref[n].norm()).item() for n, g in grads.items()}
    return sorted(stage.param_names), loss.item(), ref_loss, errs


def test_pure_gpipe_grad_equals_one_process(run_on_ranks):
    out = run_on_ranks(_gpipe, 2)
    names = [n for r in out for n in r[0]]
    assert sorted(names) == sorted(n for n, _ in GPT(CFG).named_parameters())  # each parameter on one stage
    assert out[0][1] == 0.0 and out[1][1] == pytest.approx(out[1][2], rel=1e-6)  # the last stage holds the loss
    for _, _, _, errs in out:
        assert max(errs.values()) < 1e-6, errs


def _empty_buffer(rank, world):
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = testing.mesh((2, 1), ("pp", "dp"))
    plan = fsdpfn.pipeline_plan(model, mesh, units=UNITS)
    stage = plan.stage_plan(rank)
    params = fsdpfn.shard({n: p for n, p in model.named_parameters() if n in stage.param_names}, stage)
    group = mesh.get_group("pp")
    xs, ys = _data()

    def pipelined_loss(ps):
        full = fsdpfn.unshard(ps, stage)
        if rank == 0:
            return fsdpfn.comm.pp_send_recv(_stage0(model, full, xs[0]), (0,), group).sum()
        h = fsdpfn.comm.pp_send_recv(torch.empty(0), (BATCH, CFG.seq_len, CFG.width), group)  # outside the graph
        return F.cross_entropy(_stage1(model, full, h).flatten(0, 1), ys[0].flatten())

    start = time.monotonic()
    try:
        with fsdpfn.comm.timeout_scope(60):
            torch.func.grad(pipelined_loss)(params)
    except Exception as e:  # noqa: BLE001 - what each rank is told, and how soon
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def test_an_empty_buffer_outside_the_graph_is_named_on_every_rank_not_waited_for():
    # Rank 1 would never run the backward hop: rank 0 used to wait in it until the timeout.
    out = testing.run_on_ranks(_empty_buffer, 2, timeout=120)
    for kind, message, seconds in out:  # the sender is told the same, at once, not left waiting
        assert kind == "ValueError" and "on rank 1" in message and "torch.empty(0)" in message, (kind, message)
        assert "reshape(-1)[:0]" in message and seconds < 30, (message, seconds)
