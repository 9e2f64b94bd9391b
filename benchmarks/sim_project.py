"""Projects fsdpfn plans of Llama-style 8B and 70B models to 8..1,024 GPUs with ``fsdpfn.sim``,
and shows the plan search beside the default zero3 plan.

Nothing here runs on a GPU: the models are built on the meta device, their plans are abstract
(``fsdpfn.plan(model, (G,))`` or HSDP ``(G/8, 8)``), their compute is profiled on meta
(``fsdpfn.sim.profile``: every operator's FLOPs and bytes, nothing computed), and the hardware
is the H100 SXM preset: datasheet peaks, the kernel model's measured efficiencies and the
calibrated sustained fraction, eight network cards per node (``benchmarks/sim_published.py``
checks it against published runs); ``--flops-derate`` and ``--net-derate`` scale it further. Every row keeps the global batch fixed (``--global-tokens``,
4M tokens by default, sequences of ``--seq`` tokens), so fewer GPUs run more micro-batches per step
(the runtime's ``accumulate="reduce"``: every micro-batch gathers and reduces).

Printed per row: step time, the communication the compute stream waits for (exposed), the peak
memory per GPU (masters, gradients, optimizer state, unsharded parameters, activations,
buffers), model FLOPs utilisation, and Muon's step time over AdamW's on the same plan.

Usage:
  python benchmarks/sim_project.py                       # the README tables
  python benchmarks/sim_project.py --models 8b --gpus 8,64 --no-search   # a quick look
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
import fsdpfn
from fsdpfn import runtime, sim
from fsdpfn.models import LLAMA3_8B, LLAMA3_70B, Llama

LLAMA = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}


def meta_llama(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return Llama(LLAMA[name])


# ---------------------------------------------------------------------------------------------
# Projection
# ---------------------------------------------------------------------------------------------

MP = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
OPTIMIZERS = {"adamw": sim.AdamW(), "muon owner": sim.Muon(layout="owner"), "muon gather": sim.Muon(layout="gather")}


def hardware(args) -> sim.Hardware:
    return sim.H100_SXM.scaled(
        flops=args.flops_derate,
        bandwidth=args.net_derate,
        name=f"H100 SXM x{args.flops_derate} FLOP/s, x{args.net_derate} link bandwidth",
    )


def workload(model, plan, seq, checkpointing):
    x = torch.zeros(1, seq, dtype=torch.long, device="meta")
    wl = sim.profile(model, plan, x, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1).float(), x.flatten()))
    return wl.with_activation_checkpointing() if checkpointing else wl


def project(args, hw):
    rows = []
    for name in args.models:
        model = meta_llama(name)
        n_params = sum(p.numel() for p in model.parameters())
        ckpt = name in args.checkpointing
        wl_cache = {}
        for gpus in args.gpus:
            micro = max(1, args.global_tokens // (args.seq * gpus))
            for mesh in _meshes(gpus):
                plan = fsdpfn.plan(model, mesh, mp=MP)
                key = tuple(u.name for u in plan.units)
                if key not in wl_cache:
                    wl_cache[key] = workload(model, plan, args.seq, ckpt)
                wl = wl_cache[key]
                base = None
                for opt_name, opt in OPTIMIZERS.items():
                    t0 = time.perf_counter()
                    r = sim.simulate(plan, runtime.schedule(plan), wl, opt, hw, micro_batches=micro)
                    step, exposed = r.step_time, r.exposed_comm
                    if opt_name == "adamw":
                        base = step
                    tokens = micro * args.seq
                    model_flops = 6 * n_params * tokens  # per GPU, the usual 6 N T
                    mfu = model_flops / (step * sim.H100_SXM.flops("bfloat16"))
                    ns = opt.cost(plan).ns_flops
                    rows.append(
                        dict(
                            model=name,
                            gpus=gpus,
                            mesh="x".join(map(str, mesh)),
                            opt=opt_name,
                            micro=micro,
                            step=step,
                            exposed=exposed,
                            peak=r.memory["reserved"],
                            mfu=mfu,
                            overhead=step / base - 1,
                            opt_time=r.optimizer_time,
                            inter=r.level_bytes["inter"],
                            ns_busiest=max(ns) if ns else 0.0,
                            train_flops=wl.flops * micro,
                            seconds=time.perf_counter() - t0,
                            ckpt=ckpt,
                        )
                    )
    return rows


def _meshes(gpus):
    out = [(gpus,)]
    if gpus > 8:
        out.append((gpus // 8, 8))  # HSDP: shard within a node, replicate across nodes
    if gpus > 64:
        out.append((gpus // 64, 64))  # HSDP: shard over 8 nodes (the 70B's state fits there)
    return out


def print_projection(rows, hw):
    gib = 2**30
    print(f"\nhardware: {hw.name}\n")
    print(
        "| model | GPUs | mesh | optimizer | micro-batches/GPU | step | exposed comm | optimizer step | peak memory/GPU | MFU | Muon / AdamW |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        over = "" if r["opt"] == "adamw" else f"{r['overhead'] * 100:+.1f}%"
        fits = "" if r["peak"] <= hw.memory else f" (> {hw.memory / gib:.1f} GiB)"
        print(
            f"| {r['model']}{' (AC)' if r['ckpt'] else ''} | {r['gpus']:,} | {r['mesh']} | {r['opt']} | {r['micro']} | {r['step']:.2f} s | "
            f"{r['exposed']:.2f} s | {r['opt_time'] * 1e3:.0f} ms | {r['peak'] / gib:.1f} GiB{fits} | {r['mfu'] * 100:.0f}% | {over} |"
        )


# ---------------------------------------------------------------------------------------------
# Search vs the default plan
# ---------------------------------------------------------------------------------------------


def search_demo(args, hw):
    print("\n## plan search vs the default (zero3 on (G,), prefetch 1)\n")
    model = meta_llama("8b")
    x = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    cases = [
        ("8B, 64 GPUs, 80 GB, AdamW", 64, 80e9, sim.AdamW(), hw),
        ("8B, 1,024 GPUs, 80 GB, Muon owner", 1024, 80e9, sim.Muon(), hw),
        ("8B, 64 GPUs, tight: the default's own peak, AdamW", 64, None, sim.AdamW(), hw),
        (
            "8B, 64 GPUs, 80 GB, AdamW, links 100x faster",
            64,
            80e9,
            sim.AdamW(),
            hw.scaled(bandwidth=100.0, name="fast links"),
        ),
    ]
    cache = {}
    print("| case | default step | pick | pick step | speedup | pick peak / budget |")
    print("|---|---|---|---|---|---|")
    for label, gpus, budget, opt, h in cases:
        micro = max(1, args.global_tokens // (args.seq * gpus))
        if budget is None:
            plan = fsdpfn.plan(model, (gpus,), mp=MP)
            key = tuple(u.name for u in plan.units)
            if key not in cache:
                cache[key] = sim.profile(model, plan, x)
            budget = sim.simulate(plan, runtime.schedule(plan), cache[key], opt, h, micro_batches=micro).memory["peak"]
        t0 = time.perf_counter()
        res = sim.search(
            model,
            gpus,
            budget,
            x,
            hardware=h,
            optimizer=opt,
            mp=MP,
            units=[None],
            prefetch=(0, 1, 2),
            workloads=cache,
            micro_batches=micro,
            accumulate=("reduce", "local"),
        )
        pick = res.candidate.describe() if res.speedup > 1 else "the default"
        print(
            f"| {label} | {res.default.step_time * 1e3:.0f} ms | {pick} | {res.result.step_time * 1e3:.0f} ms | "
            f"{res.speedup:.2f}x | {res.result.memory['peak'] / 2**30:.1f} / {budget / 2**30:.1f} GiB |  "
            f"<!-- {len(res.candidates)} candidates, {time.perf_counter() - t0:.0f} s -->"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="8b,70b")
    p.add_argument("--gpus", default="8,64,256,1024")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--global-tokens", type=int, default=4 * 1024 * 1024)
    p.add_argument("--checkpointing", default="70b", help="models run with activation checkpointing per block")
    p.add_argument("--flops-derate", type=float, default=1.0)
    p.add_argument("--net-derate", type=float, default=1.0)
    p.add_argument("--no-search", action="store_true")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.gpus = [int(g) for g in args.gpus.split(",")]
    args.checkpointing = set(args.checkpointing.split(",")) if args.checkpointing else set()
    print("$ python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])))
    hw = hardware(args)
    print(hw)
    t0 = time.perf_counter()
    rows = project(args, hw)
    print_projection(rows, hw)
    print(f"\n({time.perf_counter() - t0:.0f} s to simulate {len(rows)} rows)")
    if not args.no_search:
        search_demo(args, hw)


if __name__ == "__main__":
    main()
