"""Muon's distributed Newton–Schulz on a GPT-style model, measured on gloo ranks.

Prints, per the rules of BENCHMARKS.md (both sides in one launch, interleaved, median of the
pairwise ratios, min-max spread; counts beside times):

1. Newton–Schulz FLOPs summed over ranks / one-process FLOPs, for the "owner" and "gather"
   layouts (FlopCounterMode around ``opt.update`` on every rank; goal 1.0 for owner, W for gather).
2. Muon's extra collective bytes per rank per step (fsdpfn.count_collectives) against the theory
   ``2 (W-1)/W^2 * Psi_M`` (owner) and ``(W-1)/W * Psi_M`` (gather), with Psi_M the Muon matrices'
   bytes in the Newton–Schulz dtype (bf16: that is what is sent).
3. Optimizer step time, owner vs gather.
4. The whole zero3 training step with ``muon`` / the same with ``adamw`` (goal <= 1.15x).

Usage:
  python benchmarks/muon.py                       # width 512, 4 blocks, vocab 4096, seq 256, batch 4/rank
  python benchmarks/muon.py --width 128 --steps 5 # a quick look
  python benchmarks/muon.py --ns-dtype float32    # fp32 Newton-Schulz (CPUs without native bf16 matmul)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn.models import GPT, GPTConfig


def _max_over_ranks(t: float) -> float:
    buf = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.item()


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return out, _max_over_ranks(time.perf_counter() - t0)


def _bench(rank, world, cfg_kw, batch, steps, warmup, ns_dtype):
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params0 = fsdpfn.shard(model, plan)
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(ps):
        logits = torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    grad_fn = torch.func.grad(loss_fn)
    with FlopCounterMode(display=False) as f:
        grads = grad_fn(params0)
    train_flops = f.get_total_flops()
    ns_dtype = getattr(torch, ns_dtype)
    opts = {
        "owner": optim.muon(lr=0.02, layout="owner", ns_dtype=ns_dtype),
        "gather": optim.muon(lr=0.02, layout="gather", ns_dtype=ns_dtype),
        "adamw": optim.adamw(3e-4, weight_decay=0.1),
    }
    states = {k: o.init(params0) for k, o in opts.items()}

    # 1-2: count FLOPs and bytes of one update per layout.
    counts = {}
    for k in ("owner", "gather"):
        with fsdpfn.count_collectives() as c, FlopCounterMode(display=False) as f:
            opts[k].update(grads, states[k], params0)
        counts[k] = dict(flops=f.get_total_flops(), wire=sum(c.wire_bytes().values()), calls=c.counts())
    muon_names = [n for n, p in params0.items() if optim.muon_labels(n, p) == "muon"]
    one_process_flops = sum(optim.newton_schulz_flops(tuple(params0[n].shape)) for n in muon_names)
    psi_m = sum(params0[n].numel() * ns_dtype.itemsize for n in muon_names)  # bytes as sent

    # 3: optimizer step, owner vs gather, interleaved.
    opt_times = {"owner": [], "gather": []}
    for i in range(warmup + steps):
        for k in ("owner", "gather"):
            _, t = _timed(lambda: opts[k].update(grads, states[k], params0))
            if i >= warmup:
                opt_times[k].append(t)

    # 4: whole training step, muon (owner) vs adamw, interleaved, each on its own trajectory.
    run = {"muon": [params0, opts["owner"], states["owner"]], "adamw": [params0, opts["adamw"], states["adamw"]]}
    step_times = {"muon": [], "adamw": []}

    def train_step(k):
        params, opt, state = run[k]
        g = grad_fn(params)
        updates, state = opt.update(g, state, params)
        run[k][0], run[k][2] = optim.apply_updates(params, updates), state

    for i in range(warmup + steps):
        for k in ("muon", "adamw"):
            _, t = _timed(lambda: train_step(k))
            if i >= warmup:
                step_times[k].append(t)
    return dict(train_flops=train_flops, counts=counts, one_process_flops=one_process_flops, psi_m=psi_m, opt_times=opt_times, step_times=step_times, n_muon=len(muon_names))


def _ratio_line(name, a, b):
    ratios = [x / y for x, y in zip(a, b)]
    return (
        f"| {name} | {statistics.median(a):.3f} s | {statistics.median(b):.3f} s | "
        f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="Newton-Schulz dtype (torch.optim.Muon: bfloat16)")
    args = ap.parse_args()
    cfg_kw = dict(vocab_size=args.vocab, seq_len=args.seq, width=args.width, depth=args.depth, heads=args.heads)
    w = args.world
    res = testing.run_on_ranks(_bench, w, cfg_kw, args.batch, args.steps, args.warmup, args.ns_dtype, timeout=7200)
    r0 = res[0]
    one, psi = r0["one_process_flops"], r0["psi_m"]
    print(f"command: python {' '.join(sys.argv)}")
    print(f"model: GPTConfig({cfg_kw}), batch {args.batch}/rank, {w} gloo ranks, zero3, 1 thread/rank, torch {torch.__version__}")
    owner_max = max(r["counts"]["owner"]["flops"] for r in res)
    train = max(r["train_flops"] for r in res)
    print(f"Muon matrices: {r0['n_muon']}, Psi_M = {psi / 2**20:.2f} MiB ({args.ns_dtype}, as sent), one-process NS FLOPs = {one / 1e9:.2f} GFLOP/step")
    print(f"forward+backward FLOPs per rank = {train / 1e9:.2f} GFLOP; owner NS FLOPs on the busiest rank = {owner_max / 1e9:.2f} GFLOP;")
    print(f"FLOP-ideal muon/adamw whole-step ratio = (train + NS busiest rank) / train = {(train + owner_max) / train:.2f}x\n")
    print("| layout | NS FLOPs summed over ranks / one process | max rank / mean | bytes/rank/step (mean over ranks) | theory | measured/theory | collectives |")
    print("|---|---|---|---|---|---|---|")
    for k, theory in (("owner", 2 * (w - 1) / w**2 * psi), ("gather", (w - 1) / w * psi)):
        flops = [r["counts"][k]["flops"] for r in res]
        wire = statistics.mean(r["counts"][k]["wire"] for r in res)
        print(
            f"| {k} | {sum(flops) / one:.3f} | {max(flops) / statistics.mean(flops):.3f} | {wire / 2**20:.2f} MiB | "
            f"{theory / 2**20:.2f} MiB | {wire / theory:.3f} | {r0['counts'][k]['calls']} |"
        )
    print(f"\n| timed ({args.steps} interleaved pairs, max over ranks) | A median | B median | A/B median of pairs | A/B min-max |")
    print("|---|---|---|---|---|")
    print(_ratio_line("optimizer step: owner (A) vs gather (B)", r0["opt_times"]["owner"], r0["opt_times"]["gather"]))
    print(_ratio_line("training step: muon owner (A) vs adamw (B)", r0["step_times"]["muon"], r0["step_times"]["adamw"]))


if __name__ == "__main__":
    main()
