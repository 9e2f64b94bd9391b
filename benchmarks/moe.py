"""Mixture of experts on 4 gloo ranks: plain FSDP (every rank runs every expert, experts sharded
over dp) against expert parallelism on (ep, edp) = (2, 2) and (4, 1), one launch, interleaved.

Prints, per mesh, per rank per training step (Runtime, loss.backward(), AdamW):

1. collective calls and bytes by kind, counted (fsdpfn.count_collectives) beside what
   ``plan.cost(tokens=...)`` lists (the all-to-alls' listed bytes assume balanced routing; the
   counted ones are what this routing sent, the larger of what a rank sent and received);
2. Muon's collectives for the expert weights alone (owner layout): none, on every mesh: dim 0 of
   a packed ``[experts, ...]`` weight is the expert index, so every rank's rows are whole experts;
3. step time, median over interleaved rounds, and the median [min-max] of its round-by-round
   ratio to plain FSDP.

Usage:
  python benchmarks/moe.py                      # width 256, 8 experts, top-2, 2 blocks, 512 tokens/rank
  python benchmarks/moe.py --width 128 --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn.models import MoE, MoEConfig

MESHES = [("dp=4", (4,), None), ("ep=2 x edp=2", (2, 2), ("ep", "edp")), ("ep=4", (4, 1), ("ep", "edp"))]


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.width)
        self.moe = MoE(cfg)
        self.fc = nn.Linear(cfg.width, cfg.width)

    def forward(self, h):
        y, aux = self.moe(self.norm(h))
        return h + y + self.fc(h), aux


class Net(nn.Module):
    def __init__(self, cfg: MoEConfig, depth: int):
        super().__init__()
        self.inp = nn.Linear(cfg.width, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(depth))

    def forward(self, x):
        x, aux = self.inp(x), 0.0
        for b in self.blocks:
            x, a = b(x)
            aux = aux + a
        return (x**2).mean() + aux


def _run(rank, world, args):
    cfg = MoEConfig(width=args.width, hidden=2 * args.width, experts=args.experts, top_k=2)
    setups = []
    for label, shape, names in MESHES:
        torch.manual_seed(0)
        model = Net(cfg, args.depth)
        plan = fsdpfn.plan(model, testing.mesh(shape, names))
        params = fsdpfn.shard(model, plan, requires_grad=True)
        rt = fsdpfn.runtime.Runtime(model, plan)
        opt = optim.adamw(lr=1e-3)
        setups.append(dict(label=label, plan=plan, params=params, rt=rt, opt=opt, state=opt.init(params)))
    x = torch.randn(args.tokens, args.width, generator=torch.Generator().manual_seed(rank))

    def step(s):
        loss = s["rt"].apply(s["params"], x)
        loss.backward()
        grads = {n: p.grad for n, p in s["params"].items()}
        updates, s["state"] = s["opt"].update(grads, s["state"], s["params"])
        s["params"] = {n: p.detach().requires_grad_() for n, p in optim.apply_updates(s["params"], updates).items()}

    out = {}
    for s in setups:
        with fsdpfn.count_collectives() as counter:
            step(s)
        listed = s["plan"].cost(tokens=args.tokens).collectives
        counted = {}
        for c in counter.calls:
            k = counted.setdefault(c.kind, [0, 0])
            k[0] += 1
            k[1] += c.nbytes
        experts = {n: p.grad for n, p in s["params"].items() if n.endswith(("w1", "w2"))}
        muon = optim.scale_by_muon(ns_dtype=torch.float32)
        with fsdpfn.count_collectives() as mc:
            muon.update(experts, muon.init(experts))
        out[s["label"]] = dict(
            counted=counted, listed={k: (v.calls, v.nbytes) for k, v in listed.items()}, muon=mc.counts(), times=[]
        )
    for _ in range(args.warmup):
        for s in setups:
            step(s)
    for _ in range(args.steps):
        for s in setups:  # interleaved: the same machine state for every mesh
            torch.distributed.barrier()
            t = time.perf_counter()
            step(s)
            torch.distributed.barrier()
            out[s["label"]]["times"].append(time.perf_counter() - t)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    res = testing.run_on_ranks(_run, 4, args)[0]
    print(
        f"4 gloo ranks, width {args.width}, {args.experts} experts top-2, {args.depth} blocks, {args.tokens} tokens/rank"
    )
    base = res["dp=4"]["times"]
    for label, r in res.items():
        t = statistics.median(r["times"])
        ratios = [a / b for a, b in zip(r["times"], base)]  # pair by pair: the same round of the machine
        print(
            f"\n{label}: step {t * 1e3:.1f} ms, {statistics.median(ratios):.2f}x dp=4 [{min(ratios):.2f}-{max(ratios):.2f}]; "
            f"Muon on the experts: {r['muon'] or 'no collective'}"
        )
        for kind in sorted(set(r["counted"]) | set(r["listed"])):
            c, lst = r["counted"].get(kind, (0, 0)), r["listed"].get(kind, (0, 0))
            print(
                f"  {kind:15s} counted {c[0]:3d} calls {c[1] / 2**10:9.1f} KiB   listed {lst[0]:3d} calls {lst[1] / 2**10:9.1f} KiB"
            )


if __name__ == "__main__":
    main()
