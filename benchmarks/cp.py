"""Context parallelism: per-rank activation memory and bytes per step against the formula on 4 gloo
ranks, and the simulator's projection of Llama-3-8B at 32k-256k tokens on 8 H100s beside
torchtitan's published throughput.

1. **gloo** (``--seqs``, default 1k-16k tokens, at cp = 1, 2, 4 on a ``(4 / cp, cp)`` mesh of
   ``("dp", "cp")``): a small GPT (width 32, one block, 2 heads, vocabulary 256, fp32), one
   sequence per data-parallel rank, one training step of the pure loop (``loss.backward()``
   through ``fsdpfn.unshard``) inside ``fsdpfn.context_parallel(plan, strategy=--strategy)``:

   - *bytes*: what ``fsdpfn.count_collectives`` records, split into attention's exchange over
     cp (tags ``cp_*``) and the parameters' gathers and reduce-scatters, beside the step's list
     (``plan.cost(tokens=S / cp, attention=...)``, the attention calls recorded by
     ``fsdpfn.sim.profile``), and the closed form of the exchange: ``6 L S kv (cp - 1) / cp``
     elements sent per rank (K and V forward, and again in backward with dK and dV: attention
     keeps only a rank's own keys for its backward);
   - *memory*: the bytes the forward saves for backward on the rank (``saved_tensors_hooks``,
     each storage once, unsharded parameters left out) beside the simulator's figure for the
     same rank (``fsdpfn.sim.profile`` on meta of the abstract plan: a fused kernel that keeps
     the rank's own keys and values), the ratio of the two, and the measured figure over cp =
     1's at the same length (the ideal is ``1 / cp``);
   - *budget*: for each length, the cp degrees whose measured saved bytes per rank fit
     ``--budget-mib`` (a length one rank cannot hold at cp = 1 that cp = 4 can).

2. **projection**: Llama-3-8B on 8 H100s (the SXM preset), batch 1 sequence per data-parallel
   rank, sequence ``32k x cp`` on a ``(8 / cp, cp)`` mesh (FSDP over dp x cp), bf16 parameters
   with fp32 reduction, full activation checkpointing (``remat="full"``: the recompute issues
   the exchange again), AdamW; tokens/s/GPU = ``S / (cp x step)`` beside torchtitan's
   ``docs/performance.md`` Table 2 (FSDP + CP, torch.compile and Float8, full activation
   checkpointing, local batch 1, H100 96 GB at 500 W): 3,890 / 2,540 / 1,071 / 548.

Usage:
  OMP_NUM_THREADS=1 python benchmarks/cp.py                          # gloo 1k-16k and the projection
  OMP_NUM_THREADS=1 python benchmarks/cp.py --seqs 256,1024 --no-project   # a quick look
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import runtime, sim, testing
from fsdpfn.launch import launch
from fsdpfn.models import LLAMA3_8B, GPT, GPTConfig, Llama

WORLD = 4
CPS = (1, 2, 4)
TORCHTITAN = {1: 3890, 2: 2540, 4: 1071, 8: 548}  # tokens/s/GPU, Llama 3.1 8B, 8 H100s, 32k x cp tokens
MIB = 2**20


def _cfg(args, seq: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, seq_len=seq, width=args.width, depth=args.depth, heads=args.heads, bias=False
    )


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _mesh(cp: int) -> dict:
    return {"dp": WORLD // cp, "cp": cp}


def _step(rank, world, args):
    """One counted step per (cp, sequence length): bytes per collective tag, saved bytes."""
    rows = []
    for cp in CPS:
        mesh = testing.mesh((WORLD // cp, cp), ("dp", "cp"))
        for seq in args.seqs:
            cfg = _cfg(args, seq)
            torch.manual_seed(0)
            model = GPT(cfg)
            plan = fsdpfn.plan(model, mesh)
            params = fsdpfn.shard(model, plan, requires_grad=True)
            gen = torch.Generator().manual_seed(1 + fsdpfn.transforms.dp_rank(plan))
            tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen)
            x, y = fsdpfn.context_parallel_shard((tokens[:, :-1], tokens[:, 1:]), plan)
            saved: dict[int, int] = {}
            with fsdpfn.count_collectives() as counter, fsdpfn.context_parallel(plan, strategy=args.strategy):
                full = fsdpfn.unshard(params, plan)
                skip = {t.untyped_storage()._cdata for t in full.values()}

                def pack(t):
                    key = t.untyped_storage()._cdata
                    if key not in skip:
                        saved[key] = t.untyped_storage().nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = _ce(torch.func.functional_call(model, full, (x,)), y)
                loss.backward()
            cp_sent = sum(c.wire_bytes for c in counter.calls if c.tag.startswith("cp_"))
            rest = sum(c.wire_bytes for c in counter.calls if not c.tag.startswith("cp_"))
            kinds = sorted((c.kind, c.group_size, c.nbytes, c.tag) for c in counter.calls if c.tag.startswith("cp_"))
            rows.append(dict(cp=cp, seq=seq, cp_sent=cp_sent, rest=rest, saved=sum(saved.values()), cp_calls=kinds))
            del full, loss, params
    return rows


def _listed(args, cp: int, seq: int):
    """The list's figures for one rank of (cp, seq): ``(cp exchange sent, the rest sent, the
    simulator's saved bytes, [(kind, group, nbytes, tag)] of the exchange)``."""
    cfg = _cfg(args, seq)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = fsdpfn.plan(model, _mesh(cp))
    x = torch.zeros(1, seq // cp, dtype=torch.long, device="meta")
    wl = sim.profile(model, plan, x, loss_fn=lambda out: _ce(out, x), cp_strategy=args.strategy)
    calls = fsdpfn.step_collectives(plan, reshard_after_forward=False, tokens=wl.tokens, attention=wl.attention)
    exchange = [c for c in calls if c.purpose.startswith("cp_")]
    kinds = sorted((c.kind, c.group_size, c.nbytes, c.tag) for c in exchange)
    return (
        sum(c.wire_bytes for c in exchange),
        sum(c.wire_bytes for c in calls if not c.purpose.startswith("cp_")),
        sum(b for _, b in wl.activations),
        kinds,
    )


def gloo(args) -> None:
    t0 = time.time()
    per_rank = launch(_step, WORLD, args)
    rows = per_rank[0]
    kv = args.width  # keys of every head: heads x head_dim = width (no grouped-query heads)
    print(
        f"\n({time.time() - t0:.0f} s) GPT width {args.width}, {args.depth} block(s), {args.heads} heads, vocabulary "
        f"{args.vocab}, fp32, 1 sequence per dp rank, strategy {args.strategy!r}; {WORLD} gloo ranks, rank 0's figures\n"
    )
    print(
        "| cp | seq | cp bytes counted (MiB) | listed | closed form | other bytes counted / listed | saved counted (MiB) "
        "| simulator (MiB) | counted / simulator | saved / cp=1's |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {r["seq"]: r["saved"] for r in rows if r["cp"] == 1}
    agree = 0
    for r in rows:
        cp, seq = r["cp"], r["seq"]
        cp_listed, rest_listed, sim_saved, kinds = _listed(args, cp, seq)
        closed = 6 * args.depth * seq * kv * 4 * (cp - 1) / cp
        same = kinds == r["cp_calls"] and abs(r["cp_sent"] - cp_listed) < 0.5 and abs(r["rest"] - rest_listed) < 0.5
        agree += same
        other = r["rest"] / rest_listed if rest_listed else float("nan")
        print(
            f"| {cp} | {seq:,} | {r['cp_sent'] / MIB:.3f} | {cp_listed / MIB:.3f} | {closed / MIB:.3f} | {other:.3f} "
            f"| {r['saved'] / MIB:.2f} | {sim_saved / MIB:.2f} | {r['saved'] / sim_saved:.3f} "
            f"| {r['saved'] / base[seq]:.3f} (1/cp {1 / cp:.3f}) |"
        )
    same_ranks = all(
        [(q["cp_sent"], q["rest"]) for q in other_rows] == [(q["cp_sent"], q["rest"]) for q in rows]
        for other_rows in per_rank
    )
    print(
        f"\ncp exchange counted == listed (calls, bytes) in {agree}/{len(rows)} rows; every rank sends the same: {same_ranks}"
    )
    budget = args.budget_mib * MIB
    print(f"\nSaved activations per rank (measured, the largest rank's) against a budget of {args.budget_mib:g} MiB:")
    for seq in args.seqs:
        worst = {cp: max(q["saved"] for rr in per_rank for q in rr if q["cp"] == cp and q["seq"] == seq) for cp in CPS}
        fits = [cp for cp in CPS if worst[cp] <= budget]
        print(
            f"  {seq:>6,} tokens: "
            + ", ".join(f"cp={cp} {worst[cp] / MIB:.1f} MiB" for cp in CPS)
            + f" -> fits at cp in {fits or 'none'}"
        )


def project(args) -> None:
    hw = sim.H100_SXM
    mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        model = Llama(LLAMA3_8B)
    print(
        f"\nLlama-3-8B on 8 x {hw.name}, 1 sequence per dp rank, bf16 / fp32 reduce, remat='full', AdamW, "
        f"strategy {args.strategy!r} (simulated)\n"
    )
    print(
        "| mesh | seq | step (s) | exposed comm (s) | cp bytes sent per rank (GiB) | peak memory (GiB) "
        "| tokens/s/GPU | torchtitan | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    t0 = time.time()
    for cp in args.project_cps:
        seq = 32768 * cp
        plan = fsdpfn.plan(model, {"dp": 8 // cp, "cp": cp} if cp > 1 else (8,), mp=mp, remat="full")
        x = torch.zeros(1, seq // cp, dtype=torch.long, device="meta")
        wl = sim.profile(
            model,
            plan,
            x,
            loss_fn=lambda out, x=x: F.cross_entropy(out.flatten(0, 1).float(), x.flatten()),
            cp_strategy=args.strategy,
        )
        r = sim.simulate(plan, runtime.schedule(plan), wl, sim.AdamW(), hw)
        tps = seq / (cp * r.step_time)
        cp_sent = sum(c.wire_bytes for c in r.calls if c.purpose.startswith("cp_"))
        ratios.append(tps / TORCHTITAN[cp])
        mesh = f"dp {8 // cp} x cp {cp}"
        print(
            f"| {mesh} | {seq:,} | {r.step_time:.2f} | {r.exposed_comm:.2f} | {cp_sent / 2**30:.2f} | {r.memory['peak'] / 2**30:.1f} "
            f"| {tps:,.0f} | {TORCHTITAN[cp]:,} | {ratios[-1]:.2f} |"
        )
    print(
        f"\n({time.time() - t0:.0f} s) projected / torchtitan tokens/s/GPU: "
        + ", ".join(f"{x:.2f}" for x in ratios)
        + " (torchtitan runs torch.compile and Float8 matmuls; the projection bf16 without them)"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=lambda s: [int(v) for v in s.split(",")], default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--strategy", choices=("allgather", "ring"), default="allgather")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument(
        "--budget-mib", type=float, default=16.0, help="per-rank saved-activation budget the last table checks"
    )
    p.add_argument("--project-cps", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--no-project", action="store_true")
    args = p.parse_args(argv)
    bad = [s for s in args.seqs if s % (2 * max(CPS))]
    if bad:
        p.error(
            f"--seqs {bad}: every length must divide by 2 x cp = {2 * max(CPS)} (each cp rank holds a head and a tail chunk)"
        )
    if any(cp not in TORCHTITAN for cp in args.project_cps):
        p.error(f"--project-cps takes cp degrees of torchtitan's table: {sorted(TORCHTITAN)}")
    print("$ OMP_NUM_THREADS=1 python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])))
    if not args.no_gloo:
        gloo(args)
    if not args.no_project:
        project(args)


if __name__ == "__main__":
    main()
