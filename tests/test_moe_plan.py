"""Plans over an expert-parallel axis: experts split over ``ep`` and sharded over the expert
data-parallel axis, dense parameters sharded over ``ep`` x ``edp``, on 4 gloo ranks
((ep, edp) = (2, 2) and (4, 1)), against the same model trained in one process.

Reference: one process holds the whole model and every rank's batch; its loss is the mean of
the per-rank losses, which is what averaging the ranks' gradients computes.

Tolerance: 10 steps of training within 1e-6 (relative, per parameter) of one process. Each step
computes the same products; what differs is which rows share a GEMM call and the order in which
sums are taken (an expert's gradient sums its rows by source rank, then over edp; a dense
gradient is reduce-scattered over 4 ranks instead of summed in one). Each is a reassociation of
fp32 sums of at most a few hundred terms of size ~1: ~1e-7 relative per step; AdamW divides by
sqrt(v) ~ |g|, so an update's relative error is the gradient's, and after 10 steps of lr 1e-2
the parameters differ by ~1e-8 relative. The router sees the same inputs to ~1e-7, so no token
changes experts (the router logits are far from ties at this size: checked by the reference
and the run choosing the same experts, which the 1e-6 agreement of the outputs implies).
"""

import pytest
import torch
from torch import nn

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn.models import MoE, MoEConfig

CFG = MoEConfig(width=8, hidden=12, experts=4, top_k=2, aux_weight=0.1)
TOKENS = 16
STEPS = 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(CFG.width)
        self.moe = MoE(CFG)
        self.fc = nn.Linear(CFG.width, CFG.width)

    def forward(self, h):
        y, aux = self.moe(self.norm(h))
        return h + y + 0.5 * torch.tanh(self.fc(h)), aux


class Net(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.inp = nn.Linear(CFG.width, CFG.width)
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])

    def forward(self, x):
        h, aux = self.inp(x), 0.0
        for b in self.blocks:
            h, a = b(h)
            aux = aux + a
        return (h**2).mean() + aux


def _model():
    torch.manual_seed(0)
    return Net()


def _tokens(rank, step):
    return torch.randn(TOKENS, CFG.width, generator=torch.Generator().manual_seed(1000 * step + rank))


def _opt(kind):
    if kind == "adamw":
        return optim.adamw(lr=1e-2, weight_decay=0.1)
    # Muon on the >= 2-D weights (the packed experts are batches of matrices), AdamW on the rest
    # and on the router: a router's gradient has an exact null direction (a softmax's gradient
    # over the experts sums to zero per token), which holds only rounding noise, and
    # Newton-Schulz blows a direction with a tiny singular value up by its slope at 0 (3.4445
    # per iteration, ~490x over 5): its update is noise-dominated in one process too.
    return optim.muon(lr=2e-2, adamw_lr=1e-2, ns_dtype=torch.float32,
                      labels=lambda n, p: "muon" if p.dim() >= 2 and "router" not in n else "adamw")


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _train(rank, world, mesh_shape, names, kind, style):
    mesh = testing.mesh(mesh_shape, names)
    model = _model()
    plan = fsdpfn.plan(model, mesh)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = fsdpfn.shard(model, plan, requires_grad=style == "backward")
    opt, ref_opt = _opt(kind), _opt(kind)
    state, ref_state = opt.init(params), ref_opt.init(ref)
    me = fsdpfn.transforms.dp_rank(plan)
    rt = fsdpfn.runtime.Runtime(model, plan) if style == "backward" else None
    ref_model = _model()  # a second copy, never pointed at the ep group
    for step in range(STEPS):
        x = _tokens(me, step)
        if style == "func":
            grads = torch.func.grad(lambda ps: torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,)))(params)
        else:
            rt.apply(params, x).backward()
            grads = {n: p.grad for n, p in params.items()}
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        if style == "backward":
            params = {n: p.detach().requires_grad_() for n, p in params.items()}
        chunks = [_tokens(r, step) for r in range(world)]
        ref_grads = torch.func.grad(
            lambda ps: sum(torch.func.functional_call(ref_model, ps, (c,)) for c in chunks) / world
        )(ref)
        ref_updates, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = optim.apply_updates(ref, ref_updates)
    return {n: _rel(params[n].full_tensor(), ref[n]) for n in ref}


MESHES = [
    pytest.param((2, 2), ("ep", "edp"), id="ep2xedp2"),
    pytest.param((2, 2), ("edp", "ep"), id="edp2xep2"),
    pytest.param((4, 1), ("ep", "edp"), id="ep4"),
]


@pytest.mark.parametrize("mesh_shape,names", MESHES)
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_moe_trains_like_one_process(run_on_ranks, mesh_shape, names, kind):
    for r in run_on_ranks(_train, 4, mesh_shape, names, kind, "func"):
        assert max(r.values()) < 1e-6, r


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_moe_runtime_backward_trains_like_one_process(run_on_ranks, kind):
    for r in run_on_ranks(_train, 4, (2, 2), ("ep", "edp"), kind, "backward"):
        assert max(r.values()) < 1e-6, r
