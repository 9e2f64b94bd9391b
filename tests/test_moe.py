"""The mixture-of-experts MLP with experts sharded over an expert-parallel group (ep = 2 and 4
gloo ranks), tokens dispatched and combined by differentiable all-to-alls, against the same
model with every expert in one process, under torch.func.grad and loss.backward().

Tolerance: the distributed run computes the same products; what changes is which rows share a
GEMM call (an expert's rows from every rank together instead of one rank's chunk at a time) and
the order in which an expert weight's gradient sums its rows' contributions (by source rank).
Each is a reassociation of fp32 sums of at most a few hundred terms of size ~1, so outputs and
gradients agree to ~1e-7 relative; 1e-6 is asked.
"""

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F

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


def _ep(rank, world, style, capacity_factor=None, pad=False):
    group = testing.mesh((world,)).get_group(0)
    cfg = dataclasses.replace(CFG, capacity_factor=capacity_factor, pad_to_capacity=pad)
    torch.manual_seed(0)
    full = MoE(cfg)
    ref = {n: p.detach().clone() for n, p in full.named_parameters()}
    moe = MoE(cfg, ep_group=group)
    sl = slice(rank * moe.local, (rank + 1) * moe.local)
    params = {
        "router.weight": ref["router.weight"].clone(),
        "experts.w1": ref["experts.w1"][sl].clone(),
        "experts.w2": ref["experts.w2"][sl].clone(),
    }
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
        dropped=moe.dropped,
    )


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("style", ["func", "backward"])
def test_expert_parallel_moe_equals_one_process(run_on_ranks, world, style):
    for r in run_on_ranks(_ep, world, style):
        assert r.pop("dropped") == 0 and max(r.values()) < 1e-6, r


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
@pytest.mark.parametrize("pad", [False, True], ids=["routed", "padded"])
def test_expert_parallel_moe_with_capacity_equals_one_process_per_rank_batch(run_on_ranks, world, capacity_factor, pad):
    # Each rank counts capacity on its own 24 tokens (ceil(f * 24 * 2 / 4): 6 or 12 pairs per
    # expert); the reference calls the layer once per rank's tokens, so it drops the same pairs.
    # pad: every expert's rows padded to capacity on both sides.
    results = run_on_ranks(_ep, world, "func", capacity_factor, pad)
    assert sum(r.pop("dropped") for r in results) > 0, results
    for r in results:
        assert max(r.values()) < 1e-6, r


# ---- token capacity, by hand ---------------------------------------------------------------


def _by_hand(width, experts, top_k, factor, logits):
    """A layer whose router logits are the first ``experts`` features of each token (identity
    router), so the routing is read off ``logits``; returns the layer and its tokens."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(width=width, hidden=6, experts=experts, top_k=top_k, capacity_factor=factor))
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(experts, width))
    x = torch.cat([torch.tensor(logits, dtype=torch.float32), torch.randn(len(logits), width - experts)], dim=1)
    return moe, x


def _expected(moe, x, kept, ps=None):
    """The output with only the (token, expert) pairs in ``kept``, each weighted by its softmax
    probability renormalised over the token's top-k (not over what was kept), token by token."""
    ps = dict(moe.named_parameters()) if ps is None else ps
    probs = F.softmax(x @ ps["router.weight"].T, dim=-1)
    w, chosen = probs.topk(moe.cfg.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    rows = [torch.zeros(x.shape[1]) for _ in range(x.shape[0])]
    for t, e in kept:
        k = chosen[t].tolist().index(e)
        rows[t] = rows[t] + w[t, k] * (F.gelu(x[t] @ ps["experts.w1"][e].T) @ ps["experts.w2"][e].T)
    return torch.stack(rows)


def test_capacity_drops_the_later_tokens_of_a_full_expert_top1():
    # 6 tokens, 2 experts, top-1: tokens 0, 1, 3, 4 choose expert 0, tokens 2, 5 expert 1.
    # Capacity ceil(1.0 * 6 * 1 / 2) = 3: expert 0 keeps tokens 0, 1, 3 and drops token 4.
    moe, x = _by_hand(4, 2, 1, 1.0, [[2, 0], [2, 0], [0, 2], [2, 0], [2, 0], [0, 2]])
    with torch.no_grad():
        y, _ = moe(x)
        want = _expected(moe, x, kept=[(0, 0), (1, 0), (2, 1), (3, 0), (5, 1)])
    assert moe.dropped == 1
    assert torch.equal(y[4], torch.zeros(4))  # dropped: the block's residual carries the token alone
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-7)


def test_capacity_drops_per_expert_in_token_order_top2():
    # 4 tokens, 3 experts, top-2; logits pick   token 0: {0, 1}, 1: {0, 2}, 2: {0, 1}, 3: {1, 2}.
    # Capacity ceil(0.75 * 4 * 2 / 3) = 2. Expert 0 (tokens 0, 1, 2) drops token 2; expert 1
    # (tokens 0, 2, 3) drops token 3; expert 2 (tokens 1, 3) keeps both. Token 2 keeps expert 1
    # and token 3 expert 2, each at the weight it had among its two choices.
    moe, x = _by_hand(5, 3, 2, 0.75, [[3, 2, 0], [3, 0, 2], [3, 2, 0], [0, 3, 2]])
    assert moe.cfg.capacity(4) == 2
    with torch.no_grad():
        y, _ = moe(x)
        want = _expected(moe, x, kept=[(0, 0), (0, 1), (1, 0), (1, 2), (2, 1), (3, 2)])
    assert moe.dropped == 2
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-7)
    # Dropped pairs get no gradient through their weight or their expert: token 2's choice of
    # expert 0 and token 3's of expert 1 contribute nothing.
    g = torch.func.grad(lambda ps: torch.func.functional_call(moe, ps, (x,))[0].sum())(dict(moe.named_parameters()))
    kept = [(0, 0), (0, 1), (1, 0), (1, 2), (2, 1), (3, 2)]
    want_g = torch.func.grad(lambda ps: _expected(moe, x, kept, ps).sum())(dict(moe.named_parameters()))
    for n in g:  # the same fp32 products, summed in another order: ~1e-7 relative
        torch.testing.assert_close(g[n], want_g[n], rtol=1e-5, atol=1e-6)
    # Capacity counts the tokens of one call: the same tokens twice in one call (capacity
    # ceil(0.75 * 8 * 2 / 3) = 4) keep the first 4 pairs of experts 0 (tokens 0, 1, 2, 4) and 1
    # (tokens 0, 2, 3, 4): tokens 2 and 3 keep both choices, which two calls of 4 would not;
    # token 6 loses both (its output is 0) and tokens 5 and 7 keep expert 2 only.
    with torch.no_grad():
        y8, _ = moe(torch.cat([x, x]))
        kept8 = [(0, 0), (0, 1), (1, 0), (1, 2), (2, 0), (2, 1), (3, 1), (3, 2), (4, 0), (4, 1), (5, 2), (7, 2)]
        want8 = _expected(moe, torch.cat([x, x]), kept8)
    assert moe.cfg.capacity(8) == 4 and moe.dropped == 4
    assert torch.equal(y8[6], torch.zeros(5))
    torch.testing.assert_close(y8, want8, rtol=1e-6, atol=1e-7)


def test_a_capacity_no_expert_reaches_changes_nothing():
    torch.manual_seed(0)
    x = torch.randn(TOKENS, CFG.width)
    free, capped = MoE(CFG), MoE(dataclasses.replace(CFG, capacity_factor=float(CFG.experts)))  # capacity: every pair
    capped.load_state_dict(free.state_dict())
    (y, aux), (y2, aux2) = free(x), capped(x)
    assert capped.dropped == 0 and torch.equal(y, y2) and torch.equal(aux, aux2)


@pytest.mark.parametrize(
    "factor,error,named",
    [
        (0, ValueError, "capacity_factor=0 must be a finite number > 0"),
        (-1.5, ValueError, "capacity_factor=-1.5 must be a finite number > 0"),
        (math.nan, ValueError, "capacity_factor=nan must be a finite number > 0"),
        (math.inf, ValueError, "capacity_factor=inf must be a finite number > 0"),
        ("1.25", TypeError, "capacity_factor='1.25' (str) must be a number > 0"),
        (True, TypeError, "capacity_factor=True (bool) must be a number > 0"),
    ],
)
def test_bad_capacity_factor_is_named(factor, error, named):
    with pytest.raises(error, match="MoEConfig: " + re.escape(named)):
        MoEConfig(capacity_factor=factor)
    from fsdpfn.models import GPT, GPTConfig

    with pytest.raises(error, match=re.escape(named)):
        GPT(GPTConfig(vocab_size=16, width=8, depth=1, heads=2, experts=2, capacity_factor=factor))


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
@pytest.mark.parametrize("top_k", [1, 2])
def test_padding_to_capacity_computes_the_routed_layer(factor, top_k):
    """Padded (GShard's dispatch: every expert's capacity of rows, zero rows where none was
    routed) and routed (each expert's kept rows only), one layer gives the same outputs, drops
    and gradients. The products are the same; a padded expert's matmul has more rows, which a
    GEMM may block differently, so each output element is the same dot product of K <= hidden
    = 12 terms possibly summed in another order: within K x 2^-24 of the magnitudes' sum, and
    a relative norm bound of 2 x 12 x 2^-24 ~ 1.4e-6 is asked (measured: 0, bitwise)."""
    cfg = dataclasses.replace(CFG, top_k=top_k, capacity_factor=factor)
    torch.manual_seed(0)
    routed, padded = MoE(cfg), MoE(dataclasses.replace(cfg, pad_to_capacity=True))
    padded.load_state_dict(routed.state_dict())
    x = torch.randn(TOKENS, CFG.width, requires_grad=True)
    got, want = [], []
    for moe, out in ((routed, want), (padded, got)):
        y, aux = moe(x)
        out += [y, aux, *torch.autograd.grad(_loss((y, aux)), [x, *moe.parameters()])]
    bound = 2 * CFG.hidden * 2.0**-24
    assert padded.dropped == routed.dropped, (padded.dropped, routed.dropped)
    if factor in (0.5, 4.0):  # half the slots drop pairs; capacity for every pair drops none
        assert (routed.dropped > 0) == (factor == 0.5), routed.dropped
    assert max(_rel(g, w) for g, w in zip(got, want)) <= bound


def test_padding_to_capacity_needs_a_capacity():
    with pytest.raises(
        ValueError,
        match=r"MoEConfig: pad_to_capacity=True pads each expert's rows to its capacity, so it needs a capacity_factor",
    ):
        MoEConfig(pad_to_capacity=True)
    with pytest.raises(TypeError, match=r"MoEConfig: pad_to_capacity must be a bool, got 1"):
        MoEConfig(capacity_factor=1.0, pad_to_capacity=1)


def test_capacity_reads_the_factor_as_written():
    # 1.1 * 20 * 1 / 2 is 11.000000000000002 in floats; the factor as written gives 11.
    assert MoEConfig(experts=2, top_k=1, capacity_factor=1.1).capacity(20) == 11
    assert MoEConfig(experts=8, top_k=2, capacity_factor=1.25).capacity(64) == 20
    assert MoEConfig(experts=4, top_k=2, capacity_factor=1).capacity(7) == 4  # ceil(3.5)
    assert MoEConfig().capacity(64) is None


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
