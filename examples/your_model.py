"""Bring your own model: plan, shard, train, checkpoint and reload any ``nn.Module``.

A small CNN written here (no torchvision) learns a synthetic task, on 2 gloo ranks this script
starts itself (or one rank per process under ``torchrun``):

1. ``fsdpfn.plan`` with a callable that says which modules are units (each ``ConvBlock``; the
   stem and the head form the root unit);
2. ``fsdpfn.shard``: each rank keeps its rows of every parameter;
3. ``fsdpfn.runtime.Runtime`` trains it (units gathered one at a time, prefetched, freed after
   use) with AdamW from ``fsdpfn.optim``;
4. ``fsdpfn.checkpoint.save`` writes parameters, optimizer state and step, ``checkpoint.load``
   reads them back into fresh shards, and ``checkpoint.export_full`` writes a plain state dict
   that loads into ``SmallCNN`` without fsdpfn;
5. the held-out loss of the reloaded parameters must be below the untrained model's.

    python examples/your_model.py                       # 2 ranks, zero3, 60 steps
    python examples/your_model.py --world-size 3 --strategy zero2 --steps 100
    torchrun --nproc-per-node 2 examples/your_model.py

To bring your own model, replace ``SmallCNN``, ``is_unit`` and ``make_dataset``; the rest stays.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import fsdpfn
from fsdpfn import checkpoint, optim
from fsdpfn.launch import launch, shutdown

CLASSES, SIZE = 4, 8  # 4 classes of 1 x 8 x 8 images
PER_RANK = 16  # images per rank per step unless --batch says otherwise


class ConvBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection: one unit of the plan."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.gelu(self.conv1(F.gelu(x))))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 16, depth: int = 2):
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(depth))
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, images):  # (batch, 1, SIZE, SIZE) -> (batch, CLASSES) logits
        h = self.stem(images)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


def is_unit(name: str, module: nn.Module) -> bool:
    """Which modules the plan gathers and reduces as one unit; the rest is the root unit."""
    return isinstance(module, ConvBlock)


def make_dataset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy images whose label is the quadrant that is brighter than the others."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    images = 0.5 * torch.randn(n, 1, SIZE, SIZE, generator=gen)
    half = SIZE // 2
    for i, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[i, 0, r * half : (r + 1) * half, c * half : (c + 1) * half] += 0.75
    return images, labels


def batch(step: int, global_batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank, which then takes its own rows."""
    return make_dataset(global_batch, seed=seed * 1_000_003 + step + 1)


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def train(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = SmallCNN(args.channels, args.depth)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    plan = fsdpfn.plan(model, mesh, units=is_unit, strategy=args.strategy)
    if rank == 0:
        print(plan)
    params = fsdpfn.shard(model, plan)  # {name: DTensor}, this rank's rows
    rt = fsdpfn.runtime.Runtime(model, plan, prefetch=1)

    def loss_fn(params, images, labels):
        return loss_of(rt.apply(params, images), labels)

    val_images, val_labels = make_dataset(256, seed=10_000 + args.seed)

    def val_loss(params) -> float:
        with torch.no_grad():  # gathers and frees units, no reduce
            return loss_fn(params, val_images, val_labels).item()

    opt = optim.adamw(lr=args.lr, weight_decay=0.01)
    state = opt.init(params)
    before = val_loss(params)
    per_rank = args.batch // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(args.steps):
        images, labels = batch(step, per_rank * world_size, args.seed)
        grads, loss = rt.value_and_grad(loss_fn)(params, images[mine], labels[mine])  # sharded, mean over ranks
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f} (rank 0's rows)")

    ckpt = os.path.join(args.out, "ckpt")
    saved = checkpoint.save(ckpt, {"params": params, "opt_state": state, "step": args.steps}, plan)
    fresh = fsdpfn.shard(model, plan)  # the template: shapes and placements, values replaced
    loaded = checkpoint.load(ckpt, {"params": fresh, "opt_state": opt.init(fresh), "step": 0}, plan)
    same = all(torch.equal(loaded["params"][n].to_local(), params[n].to_local()) for n in params)
    if not same or loaded["step"] != args.steps:
        raise RuntimeError(f"rank {rank}: the checkpoint read back differs from what was saved in {saved}")
    after = val_loss(loaded["params"])
    exported = checkpoint.export_full(os.path.join(args.out, "model.pt"), loaded["params"], plan, model=model)
    if rank == 0:
        print(f"held-out loss {before:.4f} -> {after:.4f} after {args.steps} steps on {world_size} ranks")
        print(f"checkpoint {saved} (reloaded: equal)\nmodel      {exported}  (plain state dict for SmallCNN)")
    return {"before": before, "after": after}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--strategy", default="zero3", choices=["replicate", "zero1", "zero2", "zero3"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"global batch (images per step, all ranks; default {PER_RANK} per rank)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--depth", type=int, default=2, help="number of ConvBlocks (units)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default="runs/your_model")
    args = p.parse_args(argv)
    # Under torchrun the launcher's WORLD_SIZE is the number of ranks, not --world-size.
    world = int(os.environ.get("WORLD_SIZE", args.world_size))
    if args.batch is None:
        args.batch = PER_RANK * world  # every rank the same number of rows, whatever the world size
    for flag in ("world_size", "steps", "batch", "channels", "depth", "log_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.batch % world:
        what = "the world size" if "WORLD_SIZE" in os.environ else "--world-size"
        p.error(
            f"--batch {args.batch} must be a multiple of {what} {world} (equal rows per rank: "
            f"the mean over ranks of per-rank means is the global mean only then)"
        )
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = launch(train, args.world_size, args)[0]
    if not result["after"] < result["before"]:
        raise SystemExit(f"the held-out loss did not go down: {result['before']:.4f} -> {result['after']:.4f}")
    return result


if __name__ == "__main__":
    main()
    shutdown()  # the job's last line: a clean exit (code 0) under torchrun too, see fsdpfn.launch.shutdown
