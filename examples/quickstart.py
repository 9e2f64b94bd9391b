"""Train a small GPT with zero3 on 2 CPU processes: the pure fsdpfn loop."""

import os

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import optim
from fsdpfn.launch import launch, shutdown
from fsdpfn.models import GPT, GPTConfig


def train(rank, world_size, steps=20):
    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, width=64, depth=2))
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    plan = fsdpfn.plan(model, mesh, strategy="zero3")  # each block a unit, the rest the root
    params = fsdpfn.shard(model, plan)  # {name: DTensor}: this rank's rows only

    def loss_fn(params, x, y):
        logits = torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    opt = optim.adamw(lr=3e-3)
    state = opt.init(params)
    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    losses = []
    for _ in range(steps):
        tokens = (torch.randint(0, 64, (8, 1), generator=data) + torch.arange(17)) % 64
        x, y = tokens[:, :-1], tokens[:, 1:]  # task: count on, modulo 64
        if not losses:  # once: the sharded step computes what one process computes, or every rank raises
            fsdpfn.verify_step(loss_fn, params, x, y)
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)  # sharded, mean over ranks
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    losses = launch(train, world_size=2)[0]  # starts 2 gloo processes (under torchrun: this one)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank runs this line: print once
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
    assert losses[-1] < losses[0] / 2, "the loss should at least halve"
    shutdown()  # the job's last line: a clean exit (code 0) under torchrun too, see fsdpfn.launch.shutdown
