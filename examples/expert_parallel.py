"""Mixture of experts over an expert-parallel axis: a small GPT whose MLPs are top-2 MoE layers,
trained with Muon on an ("ep", "edp") mesh, checkpointed, and resumed at another ep degree.

Spawns 4 gloo ranks on CPU (or runs one rank per process under torchrun):

    python examples/expert_parallel.py                     # train on (ep=2, edp=2), resume on ep=4
    python examples/expert_parallel.py --ep 4 --resume-ep 2
    torchrun --nproc-per-node 4 examples/expert_parallel.py

Each MoE layer's packed experts are split over ``ep`` (a rank holds ``experts / ep`` of them,
each sharded over ``edp``); tokens travel to their experts and back by all-to-alls; every other
parameter is sharded over all ``ep x edp`` ranks. Muon orthogonalises each expert's matrices
where they lie. At the end rank 0 compares the parameters with the same loop run in one process.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdpfn
from fsdpfn import checkpoint, optim
from fsdpfn.launch import launch, shutdown
from fsdpfn.models import MoE, MoEConfig

VOCAB, SEQ, WIDTH, HEADS, DEPTH = 64, 32, 64, 4, 2


class Block(nn.Module):
    """Pre-norm causal attention, then a top-2 mixture-of-experts MLP over the block's tokens."""

    def __init__(self, experts: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.moe = MoE(MoEConfig(width=WIDTH, hidden=2 * WIDTH, experts=experts, top_k=2, aux_weight=0.01))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, -1, 3, c // HEADS).permute(3, 0, 2, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        y, aux = self.moe(self.norm2(x).reshape(b * t, c))
        return x + y.view(b, t, c), aux


class MoEGPT(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block(experts) for _ in range(DEPTH))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        aux = 0.0
        for block in self.blocks:
            x, a = block(x)
            aux = aux + a
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten()) + aux


def batch(step: int, size: int):
    """A fixed synthetic task: continue a random arithmetic sequence mod the vocabulary."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    stride = torch.randint(1, 5, (size, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def make_opt():
    # Muon for the hidden matrices and the packed experts (each expert's matrices on their own),
    # AdamW for embeddings, head, norms and the routers (a router's gradient has an exact null
    # direction, rounding noise that Newton-Schulz would blow up). Newton-Schulz runs in fp32 so
    # that the comparison with one process at the end is sharp: in bf16 (Muon's default) the
    # fp32 reassociation of the reduced gradients flips bf16 roundings (~1e-2 apart after 20 steps).
    return optim.muon(
        lr=0.02,
        adamw_lr=3e-3,
        ns_dtype=torch.float32,
        labels=lambda n, p: (
            "muon" if p.dim() >= 2 and not any(s in n for s in ("embed", "pos", "head", "router")) else "adamw"
        ),
    )


def train(model, plan, params, state, opt, steps, per_rank):
    """The pure loop: every rank (ep x edp of them) reads its own slice of the global batch."""
    dp, me = plan.dp_size, fsdpfn.transforms.dp_rank(plan)
    mine = slice(me * per_rank, (me + 1) * per_rank)
    for step in steps:
        x, y = batch(step, dp * per_rank)
        grads, loss = torch.func.grad_and_value(
            lambda ps: torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x[mine], y[mine]))
        )(params)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state, loss


def plan_on(model, world_size: int, ep: int):
    mesh = init_device_mesh("cpu", (ep, world_size // ep), mesh_dim_names=("ep", "edp"))
    return fsdpfn.plan(model, mesh)  # the MoE layers' experts are found by themselves


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = MoEGPT(args.experts)
    reference = copy.deepcopy(model) if rank == 0 else None
    opt = make_opt()
    half = args.steps // 2

    plan = plan_on(model, world_size, args.ep)
    if rank == 0:
        print(plan)
    params = fsdpfn.shard(model, plan)  # also points the MoE layers at the ep group
    state = opt.init(params)
    params, state, loss = train(model, plan, params, state, opt, range(half), args.per_rank)
    saved = checkpoint.save(args.dir, {"params": params, "opt_state": state, "step": half}, plan)

    # Resume at another ep degree: the load reshards experts, dense parameters and Muon/AdamW state.
    plan2 = plan_on(model, world_size, args.resume_ep)
    fresh = fsdpfn.shard(model, plan2)
    loaded = checkpoint.load(args.dir, {"params": fresh, "opt_state": opt.init(fresh), "step": 0}, plan2)
    params, state, loss = train(
        model, plan2, loaded["params"], loaded["opt_state"], opt, range(loaded["step"], args.steps), args.per_rank
    )
    full = {n: p.full_tensor() for n, p in params.items()}
    if rank == 0:
        print(
            f"saved {os.path.basename(saved)} on ep={args.ep} x edp={world_size // args.ep}, resumed on "
            f"ep={args.resume_ep} x edp={world_size // args.resume_ep}; final loss {loss.item():.4f}"
        )
        ref = {n: p.detach().clone() for n, p in reference.named_parameters()}
        ref_state = opt.init(ref)
        for step in range(args.steps):
            x, y = batch(step, world_size * args.per_rank)
            chunks = [slice(r * args.per_rank, (r + 1) * args.per_rank) for r in range(world_size)]
            g = torch.func.grad(
                lambda ps: sum(torch.func.functional_call(reference, ps, (x[c], y[c])) for c in chunks) / world_size
            )(ref)
            u, ref_state = opt.update(g, ref_state, ref)
            ref = optim.apply_updates(ref, u)
        worst = max(((full[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)
        print(f"largest relative difference from one process: {worst:.2e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--world-size", type=int, default=4, help="ranks to spawn (ignored under torchrun) (default: 4)"
    )
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default: 8)")
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel degree of the first half (default: 2)")
    parser.add_argument("--resume-ep", type=int, default=4, help="expert-parallel degree after the resume (default: 4)")
    parser.add_argument("--steps", type=int, default=20, help="total training steps (default: 20)")
    parser.add_argument("--per-rank", type=int, default=4, help="sequences per rank per step (default: 4)")
    parser.add_argument(
        "--dir", default=os.path.join(tempfile.gettempdir(), "fsdpfn_ep_example"), help="checkpoint directory"
    )
    args = parser.parse_args()
    for e in (args.ep, args.resume_ep):
        if args.world_size % e or args.experts % e:
            parser.error(
                f"--ep/--resume-ep {e} must divide --world-size {args.world_size} and --experts {args.experts}"
            )
    launch(main, args.world_size, args)
    shutdown()  # the job's last line: a clean exit (code 0) under torchrun too, see fsdpfn.launch.shutdown
