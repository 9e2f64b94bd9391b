"""Tensor parallelism on 4 gloo ranks: bytes per rank per step, counted against the formula, and
the step times of the three (dp, tp) layouts of 4 ranks.

For (dp, tp) in (4, 1), (2, 2), (1, 4) -- a ("dp", "tp") mesh, ``fsdpfn.models.GPT_TP_PLAN``,
zero3, ``fsdpfn.runtime.Runtime`` with prefetch 1, AdamW, fp32 -- one launch of 4 ranks:

1. bytes: one training step of each layout counted by ``fsdpfn.comm.count_collectives``, split
   into the data-parallel axis (parameter all-gathers, gradient reduce-scatters) and the tp axis
   (activation all-reduces), each beside its formula: the data-parallel part from
   ``plan.cost(tokens=...)`` (the list of the step's collectives, ``fsdpfn.step_collectives``),
   the tp part in closed form, ``4 L N d x 4 B x 2 (T-1)/T`` for L blocks, N tokens per rank,
   width d (GPT_TP_PLAN: 2 all-reduces of N x d per block in forward, after the rowwise proj and
   out, and 2 in backward, of the colwise qkv and fc inputs' gradients);
2. time: the three layouts' steps interleaved (each round runs all three, in a rotating order),
   the slowest rank's step time; median of ``--steps`` rounds after ``--warmup``, with the
   min-max spread, and each layout's ratio to (4, 1) as the median of the round-by-round ratios.

Every layout reads 4 sequences per data-parallel rank: (4, 1) processes 16 sequences per step,
(2, 2) 8 and (1, 4) 4 -- the per-rank activation work is the same (batch 4, the model split tp
ways), the global batch is not.

Usage:
  OMP_NUM_THREADS=1 python benchmarks/tp.py                 # GPT width 256, 4 blocks, seq 128, batch 4 per dp rank
  OMP_NUM_THREADS=1 python benchmarks/tp.py --steps 3 --warmup 1   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import comm, optim, testing
from fsdpfn.launch import launch
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig
from fsdpfn.runtime import Runtime

WORLD = 4
LAYOUTS = ((4, 1), (2, 2), (1, 4))


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _sent(calls, tp_modules):
    """``(dp-axis bytes sent, tp-axis bytes sent, calls)`` per rank of counted collectives."""
    dp = sum(c.wire_bytes for c in calls if c.tag not in tp_modules)
    tp = sum(c.wire_bytes for c in calls if c.tag in tp_modules)
    return dp, tp, len(calls)


def _rank(rank, world, args):
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, width=args.width, depth=args.depth, heads=args.heads, bias=False
    )
    runs = []
    for dp, tp in LAYOUTS:
        torch.manual_seed(0)
        model = GPT(cfg)
        plan = fsdpfn.plan(model, testing.mesh((dp, tp), ("dp", "tp")), tp=GPT_TP_PLAN)
        params = fsdpfn.shard(model, plan)
        rt = Runtime(model, plan, prefetch=1)
        opt = optim.adamw(1e-3)
        gen = torch.Generator().manual_seed(1 + fsdpfn.transforms.dp_rank(plan))
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen)
        runs.append(
            dict(
                layout=(dp, tp),
                plan=plan,
                rt=rt,
                params=params,
                opt=opt,
                state=opt.init(params),
                x=tokens[:, :-1],
                y=tokens[:, 1:],
                times=[],
            )
        )

    def step(r):
        rt = r["rt"]
        grads, _ = rt.value_and_grad(lambda ps: _ce(rt.apply(ps, r["x"]), r["y"]))(r["params"])
        updates, r["state"] = r["opt"].update(grads, r["state"], r["params"])
        r["params"] = optim.apply_updates(r["params"], updates)

    n_tokens = args.batch * args.seq
    rows = []
    for r in runs:  # one counted step each (also a warm-up)
        plan = r["plan"]
        with comm.count_collectives() as counter:
            step(r)
        tp_modules = plan.tp_modules
        counted = _sent(counter.calls, tp_modules)
        cost = plan.cost(tokens=n_tokens)
        listed = _sent(cost.calls, tp_modules)
        t = plan.tp_size
        closed_tp = 4 * cfg.depth * n_tokens * cfg.width * 4 * 2 * (t - 1) / t
        rows.append(
            dict(
                layout=r["layout"],
                counted=counted,
                listed=listed,
                closed_tp=closed_tp,
                same_calls=sorted((c.kind, c.group_size, c.nbytes, c.tag) for c in counter.calls)
                == sorted((c.kind, c.group_size, c.nbytes, c.tag) for c in cost.calls),
            )
        )
    for i in range(args.warmup + args.steps):
        order = runs[i % len(runs) :] + runs[: i % len(runs)]
        for r in order:
            comm.barrier()
            t0 = time.perf_counter()
            step(r)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            comm.all_reduce(dt, op="max").wait()
            if i >= args.warmup:
                r["times"].append(dt.item())
    for row, r in zip(rows, runs):
        row["times"] = r["times"]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    print("$ OMP_NUM_THREADS=1 python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])))
    print(
        f"GPT width {args.width}, {args.depth} blocks, {args.heads} heads, vocabulary {args.vocab}, sequence {args.seq}, "
        f"batch {args.batch} per dp rank, fp32, zero3, Runtime(prefetch=1), AdamW; {WORLD} gloo ranks, "
        f"{args.steps} interleaved steps after {args.warmup} warm-up rounds"
    )
    t0 = time.time()
    per_rank = launch(_rank, WORLD, args)
    rows = per_rank[0]
    same_ranks = all(
        [(q["counted"], q["same_calls"]) for q in other] == [(q["counted"], q["same_calls"]) for q in rows]
        for other in per_rank
    )
    mib = 2**20
    print(
        f"\n({time.time() - t0:.0f} s) bytes sent per rank per step (MiB); formula: dp axis plan.cost(tokens={args.batch * args.seq}), "
        "tp axis 4 L N d x 4 B x 2(T-1)/T\n"
    )
    print(
        "| dp x tp | collectives | dp axis counted | dp axis formula | tp axis counted | tp axis formula | total counted / formula |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        dp_c, tp_c, n = r["counted"]
        dp_f = r["listed"][0]
        total_f = dp_f + r["closed_tp"]
        ratio = (dp_c + tp_c) / total_f if total_f else float("nan")
        print(
            f"| {r['layout'][0]} x {r['layout'][1]} | {n} | {dp_c / mib:.3f} | {dp_f / mib:.3f} | {tp_c / mib:.3f} | "
            f"{r['closed_tp'] / mib:.3f} | {ratio:.4f} |"
        )
    print(
        f"\nevery call equal to the list (kind, group size, bytes, tag) on every layout: {all(r['same_calls'] for r in rows)}; "
        f"the same counts on every rank: {same_ranks}; plan.cost()'s tp part equals the closed form: "
        f"{all(abs(r['listed'][1] - r['closed_tp']) < 1e-6 for r in rows)}"
    )
    base = rows[0]["times"]
    print(f"\nstep time, slowest rank, {args.steps} interleaved rounds\n")
    print(
        "| dp x tp | median [min-max] | ratio to 4 x 1, median of rounds [min-max] | sequences per step | sequences / s (median) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        ratios = [a / b for a, b in zip(r["times"], base)]
        med = statistics.median(r["times"])
        seqs = r["layout"][0] * args.batch
        print(
            f"| {r['layout'][0]} x {r['layout'][1]} | {med * 1e3:.0f} ms "
            f"[{min(r['times']) * 1e3:.0f}-{max(r['times']) * 1e3:.0f}] | {statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}-{max(ratios):.2f}] | {seqs} | {seqs / med:.1f} |"
        )


if __name__ == "__main__":
    main()
