"""The mixture-of-experts MLP with experts sharded over an expert-parallel group (ep = 2 and 4
gloo ranks), tokens dispatched and combined by differentiable all-to-alls, against the same
model with every expert in one process, under torch.func.grad and loss.backward().

Tolerance: the distributed run computes the same products; what changes is which rows share a
GEMM call (an expert's rows from every rank together instead of one rank's chunk at a time) and
the order in which an expert weight's gradient sums its rows' contributions (by source rank).
Each is a reassociation of fp32 sums of at most a few hundred terms of size ~1, so outputs and
gradients agree to ~1e-7 relative; 1e-6 is asked.
"""

import pytest
import torch

import fsdpfn
from fsdpfn import comm as C
from fsdpfn import testing
from fsdpfn.models import MoE, MoEConfig

CFG = MoEConfig(width=8, hidden=12, experts=4, top_k=2, aux_weight=0.1)
TOKENS = 24


def _tokens(rank):
    return torch.randn(TOKENS, CFG.width, generator=torch.Generator().manual_seed(100 + rank))


def _loss(out):
    y, aux = out
    return (y**2).mean() + aux


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _ep(rank, world, style):
    group = testing.mesh((world,)).get_group(0)
    torch.manual_seed(0)
    full = MoE(CFG)
    ref = {n: p.detach().clone() for n, p in full.named_parameters()}
    moe = MoE(CFG, ep_group=group)
    sl = slice(rank * moe.local, (rank + 1) * moe.local)
    params = {"router.weight": ref["router.weight"].clone(), "experts.w1": ref["experts.w1"][sl].clone(),
              "experts.w2": ref["experts.w2"][sl].clone()}
    x = _tokens(rank)
    if style == "func":
        def loss_fn(ps):
            out = torch.func.functional_call(moe, ps, (x,))
            return _loss(out), out[0]

        grads, y = torch.func.grad(loss_fn, has_aux=True)(params)
    else:
        with torch.no_grad():
            for n, p in moe.named_parameters():
                p.copy_(params[n])
        out = moe(x)
        y = out[0].detach()
        _loss(out).backward()
        grads = {n: p.grad for n, p in moe.named_parameters()}
    router = grads["router.weight"].clone()
    C.all_reduce(router.view(-1), group)  # the dense router: its gradient summed over the ranks
    # One process: every expert here, each rank's tokens through the same model, losses summed.
    chunks = [_tokens(r) for r in range(world)]
    want = torch.func.grad(lambda ps: sum(_loss(torch.func.functional_call(full, ps, (c,))) for c in chunks))(ref)
    want_y = torch.func.functional_call(full, ref, (x,))[0]
    return dict(
        y=_rel(y, want_y),
        w1=_rel(grads["experts.w1"], want["experts.w1"][sl]),
        w2=_rel(grads["experts.w2"], want["experts.w2"][sl]),
        router=_rel(router, want["router.weight"]),
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("style", ["func", "backward"])
def test_expert_parallel_moe_equals_one_process(run_on_ranks, world, style):
    for r in run_on_ranks(_ep, world, style):
        assert max(r.values()) < 1e-6, r


def _not_divisible(rank, world):
    with fsdpfn.count_collectives() as counter:
        try:
            MoE(MoEConfig(experts=6), ep_group=testing.mesh((world,)).get_group(0))
        except ValueError as e:
            return str(e), counter.counts()
    return "no error", counter.counts()


def test_experts_not_divisible_by_ep_is_named_before_any_collective(run_on_ranks):
    for msg, counts in run_on_ranks(_not_divisible, 4):
        assert "experts=6 does not divide over the 4 expert-parallel ranks" in msg and counts == {}, (msg, counts)


def _muon_experts(rank, world):
    """Muon on the experts a rank holds: each expert's matrices orthogonalised alone, here, with
    no communication; bitwise the slice of the one-process update (fp32 and bf16)."""
    group = testing.mesh((world,)).get_group(0)
    torch.manual_seed(0)
    full = MoE(CFG)
    moe = MoE(CFG, ep_group=group)
    sl = slice(rank * moe.local, (rank + 1) * moe.local)
    gen = torch.Generator().manual_seed(3)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in full.named_parameters() if n != "router.weight"}
    ok = []
    for dtype in (torch.float32, torch.bfloat16):
        opt = fsdpfn.optim.scale_by_muon(ns_dtype=dtype)
        want, _ = opt.update(grads, opt.init(grads))
        mine = {n: g[sl] for n, g in grads.items()}
        with fsdpfn.count_collectives() as counter:
            got, _ = opt.update(mine, opt.init(mine))
        ok.append(counter.counts() == {} and all(torch.equal(got[n], want[n][sl]) for n in mine))
    return ok


def test_muon_orthogonalises_each_local_expert_alone(run_on_ranks):
    assert run_on_ranks(_muon_experts, 4) == [[True, True]] * 4
