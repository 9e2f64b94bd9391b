"""FSDP x tensor parallelism: a 2-D plan, trained, checkpointed, and resumed at another tp degree.

Spawns 4 gloo ranks on CPU (or runs one rank per process under torchrun):

    python examples/tensor_parallel.py                     # train on (dp=2, tp=2), resume on (dp=4, tp=1)
    python examples/tensor_parallel.py --resume-tp 4       # ... resume on (dp=1, tp=4)
    torchrun --nproc-per-node 4 examples/tensor_parallel.py

The first half of the steps runs on a ("dp", "tp") mesh: attention and MLP matmuls are split
over tp (Megatron-style colwise / rowwise), every parameter is sharded over dp. The state is
saved, loaded into a plan on a mesh of another shape, and training goes on. At the end rank 0
compares the parameters with the same loop run in one process on the unsharded model.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdpfn
from fsdpfn import checkpoint, optim
from fsdpfn.launch import launch, shutdown
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=32, width=64, depth=2, heads=4, bias=False)


def batch(step: int, size: int):
    """A fixed synthetic task: continue a random arithmetic sequence mod the vocabulary."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, CFG.vocab_size, (size, 1), generator=gen)
    stride = torch.randint(1, 5, (size, 1), generator=gen)
    tokens = (start + stride * torch.arange(CFG.seq_len + 1)) % CFG.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def train(model, plan, params, state, opt, steps, per_rank):
    """The pure loop: each data-parallel rank reads its slice of the global batch; ranks that
    differ only in their tp position read the same slice."""
    dp, me = plan.dp_size, fsdpfn.transforms.dp_rank(plan)
    mine = slice(me * per_rank, (me + 1) * per_rank)

    def loss_fn(params, x, y):
        logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    for step in steps:
        x, y = batch(step, dp * per_rank)
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x[mine], y[mine])
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state, loss


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = copy.deepcopy(model) if rank == 0 else None
    opt = optim.adamw(lr=3e-3, weight_decay=0.0)
    half = args.steps // 2

    # 1. (dp, tp) = (world / tp, tp): a 2-D plan is a mesh with named axes and a tp= table.
    mesh = init_device_mesh("cpu", (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    plan = fsdpfn.plan(model, mesh, tp=GPT_TP_PLAN)
    if rank == 0:
        print(plan)
    params = fsdpfn.shard(model, plan)  # also installs the tp collectives on the model
    state = opt.init(params)
    params, state, loss = train(model, plan, params, state, opt, range(half), args.per_rank)
    saved = checkpoint.save(args.dir, {"params": params, "opt_state": state, "step": half}, plan)

    # 2. Resume on a mesh of another shape: load reshards every parameter and optimizer slot.
    resume_tp = args.resume_tp
    mesh2 = init_device_mesh("cpu", (world_size // resume_tp, resume_tp), mesh_dim_names=("dp", "tp"))
    plan2 = fsdpfn.plan(model, mesh2, tp=GPT_TP_PLAN if resume_tp > 1 else None)
    fresh = fsdpfn.shard(model, plan2)
    loaded = checkpoint.load(args.dir, {"params": fresh, "opt_state": opt.init(fresh), "step": 0}, plan2)
    params, state, loss = train(
        model, plan2, loaded["params"], loaded["opt_state"], opt, range(loaded["step"], args.steps), args.per_rank
    )
    full = {n: p.full_tensor() for n, p in params.items()}
    if rank == 0:
        print(
            f"saved {os.path.basename(saved)} on dp={world_size // args.tp} x tp={args.tp}, resumed on "
            f"dp={world_size // resume_tp} x tp={resume_tp}; final loss {loss.item():.4f}"
        )
        ref = {n: p.detach().clone() for n, p in reference.named_parameters()}
        ref_state = opt.init(ref)
        dp_total = world_size // args.tp
        for step in range(args.steps):
            x, y = (
                batch(step, dp_total * args.per_rank)
                if step < half
                else batch(step, world_size // resume_tp * args.per_rank)
            )
            g = torch.func.grad(
                lambda ps: F.cross_entropy(torch.func.functional_call(reference, ps, (x,)).flatten(0, 1), y.flatten())
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
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree of the first half (default: 2)")
    parser.add_argument("--resume-tp", type=int, default=1, help="tensor-parallel degree after the resume (default: 1)")
    parser.add_argument("--steps", type=int, default=20, help="total training steps (default: 20)")
    parser.add_argument(
        "--per-rank", type=int, default=4, help="sequences per data-parallel rank per step (default: 4)"
    )
    parser.add_argument(
        "--dir", default=os.path.join(tempfile.gettempdir(), "fsdpfn_tp_example"), help="checkpoint directory"
    )
    args = parser.parse_args()
    for t in (args.tp, args.resume_tp):
        if args.world_size % t:
            parser.error(f"--tp/--resume-tp {t} must divide --world-size {args.world_size}")
    launch(main, args.world_size, args)
    shutdown()  # the job's last line: a clean exit (code 0) under torchrun too, see fsdpfn.launch.shutdown
