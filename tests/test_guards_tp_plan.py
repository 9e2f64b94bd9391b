"""Tensor-parallel mistakes the plan can see, refused when the plan is built (on every rank,
before any collective), and the fused q|k|v-major projection split ``colwise_fused:3``, trained
against one process.

[Note: the tolerance of the fused parity tests]
Against one process, a (dp, tp) run sums the same float32 terms in other orders: the rowwise
``proj`` and ``out`` add tp partial sums of K/tp products (K <= 64), the colwise layers' input
gradients add tp parts, and the data-parallel mean adds dp per-rank means. Each reassociation
moves a sum by at most (terms) x 2^-24 of its magnitude, ~64 x 6e-8 = 4e-6 in the worst case
and ~1e-7 in norm, so gradients are compared at 1e-5 relative (norm-wise). AdamW's first steps
move an element by lr x g / (|g| + eps), so an element whose gradient is within rounding of
zero can move by up to 2 lr whatever the rest does (see [Note: the tolerance of the TP parity
tests] in tests/test_tp.py): with lr = 1e-3, no biases and |p| ~ 1 per matrix, the parameters
after 3 steps are compared at 1e-5 too. A wrong split is off by 1e-2 or more.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import _StridedShard

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig, Llama, LlamaConfig

WIDTH, HEADS, VOCAB, SEQ, PER_RANK = 16, 4, 20, 8, 2


class FusedAttention(nn.Module):
    """HF GPT-2's layout: one projection whose output is q | k | v side by side."""

    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        # Heads read off the tensor: under tp a rank holds num_heads / tp of them.
        q, k, v = (z.view(b, t, -1, WIDTH // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class FusedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = FusedAttention()
        self.fc = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.out = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class FusedGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(FusedBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


FUSED_TP = {"blocks.*.attn.qkv": "colwise_fused:3", "blocks.*.attn.proj": "rowwise", "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}
PLAIN_TP = {**FUSED_TP, "blocks.*.attn.qkv": "colwise"}  # head-major split of a q|k|v-major weight: wrong
# Fused parts are not cut over a data-parallel axis > 1 yet: the blocks replicate, the root is FSDP.
REPLICATED_BLOCKS = {"*": "replicate", "<root>": "zero3"}


def _fused_model():
    torch.manual_seed(0)
    return FusedGPT()


def _batch(dp, step):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (dp * PER_RANK, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _reference(dp, steps):
    """One process: the gradients of the first step, then the parameters after each AdamW step."""
    model = _fused_model()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    grads0, out = None, []
    for step in range(steps):
        x, y = _batch(dp, step)
        g = torch.func.grad(lambda ps: _loss(torch.func.functional_call(model, ps, (x,)), y))(params)
        grads0 = g if grads0 is None else grads0
        updates, state = opt.update(g, state, params)
        params = fsdpfn.optim.apply_updates(params, updates)
        out.append(params)
    return grads0, out


def _train(rank, world, shape, tp, strategy, steps=3):
    """Worst relative differences from one process: first-step gradients (torch's and fsdpfn's
    full_tensor), then parameters after each step; and the placements of the fused weight."""
    mesh = testing.mesh(shape, ("dp", "tp"))
    ref_grads, ref = _reference(shape[0], steps)
    model = _fused_model()
    plan = fsdpfn.plan(model, mesh, strategy=strategy, tp=tp)
    me = fsdpfn.transforms.dp_rank(plan)
    mine = slice(me * PER_RANK, (me + 1) * PER_RANK)
    params = fsdpfn.shard(model, plan)
    opt = fsdpfn.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(params)
    grad_err, fsdpfn_grad_err, param_err = 0.0, 0.0, 0.0
    for step in range(steps):
        x, y = _batch(shape[0], step)
        grads = torch.func.grad(
            lambda ps: _loss(torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x[mine],)), y[mine]))(params)
        if step == 0:
            grad_err = max(_rel(g.full_tensor(), ref_grads[n]) for n, g in grads.items())
            fsdpfn_grad_err = max(_rel(fsdpfn.comm.full_tensor(g), ref_grads[n]) for n, g in grads.items())
        updates, state = opt.update(grads, state, params)
        params = fsdpfn.optim.apply_updates(params, updates)
        param_err = max(param_err, max(_rel(p.full_tensor(), ref[step][n]) for n, p in params.items()))
    return grad_err, fsdpfn_grad_err, param_err, str(params["blocks.0.attn.qkv.weight"].placements)


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)])
def test_fused_qkv_split_colwise_fused_trains_as_one_process(run_on_ranks, shape):
    """Tolerance: [Note: the tolerance of the fused parity tests]."""
    strategy = "zero3" if shape[0] == 1 else REPLICATED_BLOCKS
    for grad_err, fsdpfn_grad_err, param_err, placed in run_on_ranks(_train, shape[0] * shape[1], shape, FUSED_TP, strategy):
        assert grad_err < 1e-5 and fsdpfn_grad_err < 1e-5 and param_err < 1e-5, (grad_err, fsdpfn_grad_err, param_err)
        assert placed == "(Replicate(), _StridedShard(dim=0, sf=3))", placed


def test_plain_colwise_on_a_fused_qkv_is_wrong(run_on_ranks):
    """Why the style exists: 'colwise' gives tp rank 0 all of q and half of k (it is for head-major
    rows), and the gradients are silently wrong; the docs say which style fits which layout."""
    for grad_err, _, _, _ in run_on_ranks(_train, 2, (1, 2), PLAIN_TP, "zero3", 1):
        assert grad_err > 1e-2, grad_err


def _fused_state(rank, world, root):
    """A checkpoint of a fused plan on (1, 2) loads back bitwise, into the same plan and into a
    one-process-like (2, 1) plan without tp; Muon refuses the fused weight by name."""
    model = _fused_model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = fsdpfn.plan(model, testing.mesh((1, 2), ("dp", "tp")), tp=FUSED_TP)
    params = fsdpfn.shard(model, plan)
    fsdpfn.checkpoint.save(root, {"params": params}, plan)
    again = fsdpfn.checkpoint.load(root, {"params": fsdpfn.shard(_zeros(model), plan, check=False)}, plan)["params"]
    same_plan = all(torch.equal(again[n].full_tensor(), full[n]) for n in full)
    plan2 = fsdpfn.plan(model, testing.mesh((2, 1), ("dp", "tp")))
    other = fsdpfn.checkpoint.load(root, {"params": fsdpfn.shard(_zeros(model), plan2, check=False)}, plan2)["params"]
    other_plan = all(torch.equal(other[n].full_tensor(), full[n]) for n in full)
    try:
        opt = fsdpfn.optim.muon(lr=0.02, ns_dtype=torch.float32)
        opt.update(params, opt.init(params), params)
        muon = "no error"
    except NotImplementedError as e:
        muon = str(e)
    return same_plan, other_plan, muon


def _zeros(model):
    return {n: torch.zeros_like(p) for n, p in model.named_parameters()}


def test_fused_weights_checkpoint_by_path_and_muon_refuses_them_by_name(run_on_ranks, tmp_path):
    for same_plan, other_plan, muon in run_on_ranks(_fused_state, 2, str(tmp_path / "ckpt")):
        assert same_plan and other_plan
        assert "'blocks.0.attn.qkv.weight'" in muon, muon
