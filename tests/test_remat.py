"""Activation checkpointing (``fsdpfn.plan(..., remat="full")``) in the runtime: a unit keeps only
its inputs in forward and recomputes its forward in backward on the parameters the schedule
gathers for backward. Same arithmetic in the same order, so results are bitwise those of the
run without it; random ops replay; the recompute adds no gather; saved activations shrink."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import Runtime

CFG = GPTConfig(vocab_size=29, seq_len=8, width=16, depth=3, heads=4)
PER_RANK = 2


class DropoutMLP(nn.Module):
    """Blocks with dropout, so a recompute must replay the same random mask."""

    def __init__(self, width=16, depth=2):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.3), nn.Linear(4 * width, width))
                                    for _ in range(depth))
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def _data(step, world, model_kind):
    gen = torch.Generator().manual_seed(100 + step)
    if model_kind == "gpt":
        tokens = torch.randint(0, CFG.vocab_size, (world * PER_RANK, CFG.seq_len + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(world * PER_RANK, 5, 8, generator=gen), torch.randint(0, 3, (world * PER_RANK, 5), generator=gen)


def _train(rank, world, strategy, style, remat, model_kind, steps=5):
    torch.manual_seed(0)
    model = GPT(CFG) if model_kind == "gpt" else DropoutMLP()
    model.train()
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy=strategy, remat=remat)
    rt = Runtime(model, plan)
    params = fsdpfn.shard(model, plan, requires_grad=(style == "eager"))
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    gathers, recomputed = [], []
    torch.manual_seed(1234 + rank)  # dropout masks: the same stream with and without remat
    for step in range(steps):
        x, y = _data(step, world, model_kind)
        with fsdpfn.comm.count_collectives() as counter:
            if style == "func":
                g, _ = rt.value_and_grad(lambda ps: F.cross_entropy(rt.apply(ps, x[mine]).flatten(0, 1), y[mine].flatten()))(params)
            else:
                with rt.bind(params):
                    F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten()).backward()
                g = rt.grads(params)
        gathers.append(counter.counts().get("all_gather", 0))
        recomputed.append(list(rt.last_step.recomputed))
        with torch.no_grad():
            params = {n: (p - 0.2 * g[n]).detach().requires_grad_(style == "eager") for n, p in params.items()}
    return {n: p._local_tensor for n, p in params.items()}, gathers, recomputed


@pytest.mark.parametrize("style", ["func", "eager"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize("model_kind", ["gpt", "dropout"])
def test_full_remat_is_bitwise_the_run_without_it(run_on_ranks, strategy, style, model_kind):
    plain = run_on_ranks(_train, 2, strategy, style, None, model_kind)
    remat = run_on_ranks(_train, 2, strategy, style, "full", model_kind)
    units = [f"blocks.{i}" for i in reversed(range(CFG.depth if model_kind == "gpt" else 2))]
    for (p0, g0, r0), (p1, g1, r1) in zip(plain, remat):
        assert all(torch.equal(p0[n], p1[n]) for n in p0)
        assert g1 == g0  # the recompute reuses the backward gather: not one all-gather more
        assert all(r == [] for r in r0) and all(r == units for r in r1), r1


def test_remat_policy_per_unit_and_refused_on_the_root():
    plan = fsdpfn.plan(GPT(CFG), (2,), remat={"blocks.[02]": "full"})
    assert [u.remat for u in plan.units] == ["none", "full", "none", "full"]
    assert fsdpfn.Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="remat pattern 'layers.*' matches no unit"):
        fsdpfn.plan(GPT(CFG), (2,), remat={"layers.*": "full"})
    with pytest.raises(ValueError, match="unknown remat policy 'some'"):
        fsdpfn.plan(GPT(CFG), (2,), remat="some")
    with pytest.raises(ValueError, match="root unit cannot be rematerialised"):
        fsdpfn.plan(GPT(CFG), (2,), remat={"<root>": "full"})


def _saved_bytes(rank, world, remat):
    """Bytes autograd saves for backward during one forward (eager style), counted with
    saved-tensor hooks, each storage once; plus the inputs a rematerialised unit keeps."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=29, seq_len=64, width=32, depth=4, heads=4)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, testing.mesh((world,)), remat=remat)
    rt = Runtime(model, plan)
    params = fsdpfn.shard(model, plan, requires_grad=True)
    x = torch.randint(0, 29, (2, 64))
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t

    with rt.bind(params), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    unit_input = 2 * 64 * 32 * 4  # one (batch, seq, width) fp32 activation
    return total[0], unit_input, cfg.depth


def test_full_remat_keeps_only_unit_inputs(run_on_ranks):
    """Without remat every block's activations stay saved until backward; with it, a block keeps
    one input (its residual stream) and the saved activations are those of the root (embedding,
    final norm, head) alone: at least 3x less than without it on this model."""
    (plain, inp, depth), _ = run_on_ranks(_saved_bytes, 2, None)
    (remat, _, _), _ = run_on_ranks(_saved_bytes, 2, "full")
    assert plain / (remat + depth * inp) >= 3, (plain, remat, inp)


def _pure(rank, world, remat, style, model_kind, steps=3):
    """The pure loop (``functional_call`` over ``fsdpfn.unshard``), ``torch.func.grad`` or
    ``loss.backward()``, with the unit forwards wrapped by ``fsdpfn.shard``."""
    torch.manual_seed(0)
    model = GPT(CFG) if model_kind == "gpt" else DropoutMLP()
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3", remat=remat)
    params = fsdpfn.shard(model, plan, requires_grad=(style == "eager"))
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    torch.manual_seed(99 + rank)
    for step in range(steps):
        x, y = _data(step, world, model_kind)

        def loss_fn(ps):
            out = torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x[mine],))
            return F.cross_entropy(out.flatten(0, 1), y[mine].flatten())

        if style == "func":
            g = torch.func.grad(loss_fn)(params)
        else:
            loss_fn(params).backward()
            g = {n: p.grad for n, p in params.items()}
        with torch.no_grad():
            params = {n: (p - 0.2 * g[n]).detach().requires_grad_(style == "eager") for n, p in params.items()}
    return {n: p._local_tensor for n, p in params.items()}


@pytest.mark.parametrize("style", ["func", "eager"])
@pytest.mark.parametrize("model_kind", ["gpt", "dropout"])
def test_full_remat_in_the_pure_loop_is_bitwise_the_run_without_it(run_on_ranks, style, model_kind):
    plain = run_on_ranks(_pure, 2, None, style, model_kind)
    remat = run_on_ranks(_pure, 2, "full", style, model_kind)
    for p0, p1 in zip(plain, remat):
        assert all(torch.equal(p0[n], p1[n]) for n in p0), [n for n in p0 if not torch.equal(p0[n], p1[n])]


def test_the_remat_wrapper_really_recomputes():
    """A counter inside a unit's forward: one call per forward without remat, two (forward and
    recompute) with it, in one process."""
    calls = []
    torch.manual_seed(0)
    model = DropoutMLP()
    model.blocks[0][0].register_forward_hook(lambda *a: calls.append(1))
    x, y = _data(0, 1, "dropout")
    for remat, expected in ((None, 1), ("full", 2)):
        calls.clear()
        plan = fsdpfn.plan(model, (1,), remat=remat)
        fsdpfn.transforms.apply_remat(model, plan)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.func.grad(lambda ps: F.cross_entropy(torch.func.functional_call(model, ps, (x,)).flatten(0, 1), y.flatten()))(params)
        assert len(calls) == expected, (remat, calls)
