"""The pure training loop: shard the model, unshard inside the loss, torch.func.grad, update.

Runs on CPU with 2 gloo ranks it spawns itself, or one rank per process under torchrun:

    python examples/functional_loop.py                      # 2 local ranks, zero3
    python examples/functional_loop.py --world-size 4 --strategy zero2
    torchrun --nproc-per-node 2 examples/functional_loop.py

Each step prints the loss; at the end rank 0 checks the sharded parameters against the same loop
run in one process on the unsharded model (they agree to ~1e-6 in fp32).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import optim
from fsdpfn.launch import launch, shutdown
from fsdpfn.models import GPT, GPTConfig


def batches(steps: int, batch: int, cfg: GPTConfig):
    """A fixed synthetic task: continue a random arithmetic sequence mod the vocabulary."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
        stride = torch.randint(1, 5, (batch, 1), generator=gen)
        tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
        yield tokens[:, :-1], tokens[:, 1:]


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # same initial model on every rank
    cfg = GPTConfig(vocab_size=64, seq_len=32, width=64, depth=2, heads=4, bias=False)
    model = GPT(cfg)
    reference = copy.deepcopy(model) if rank == 0 else None
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    plan = fsdpfn.plan(model, mesh, strategy=args.strategy)
    if rank == 0:
        print(plan)

    def loss_fn(params, x, y):
        logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    params = fsdpfn.shard(model, plan)
    opt = optim.adamw(lr=args.lr)
    state = opt.init(params)
    per_rank = args.batch // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step, (x, y) in enumerate(batches(args.steps, per_rank * world_size, cfg)):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x[mine], y[mine])
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        if rank == 0:
            print(f"step {step:3d}  loss {total.item() / world_size:.4f}")

    full = {n: p.full_tensor() for n, p in params.items()}  # collective: every rank calls it
    if rank == 0:
        ref_params = {n: p.detach().clone() for n, p in reference.named_parameters()}
        ref_state = opt.init(ref_params)
        for x, y in batches(args.steps, per_rank * world_size, cfg):
            grads = torch.func.grad(
                lambda ps: F.cross_entropy(torch.func.functional_call(reference, ps, (x,)).flatten(0, 1), y.flatten())
            )(ref_params)
            updates, ref_state = opt.update(grads, ref_state, ref_params)
            ref_params = optim.apply_updates(ref_params, updates)
        worst = max(((full[n] - ref_params[n]).norm() / ref_params[n].norm()).item() for n in ref_params)
        print(f"max relative difference to the one-process run: {worst:.2e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--strategy", default="zero3", choices=["replicate", "zero1", "zero2", "zero3"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--lr", type=float, default=3e-3)
    launch(main, parser.parse_args().world_size, parser.parse_args())
    shutdown()  # the job's last line: a clean exit (code 0) under torchrun too, see fsdpfn.launch.shutdown
