"""Pipeline schedules priced from their op lists: bubbles against the closed forms, and a
405B-like model on 512 H100s (FSDP 8 x TP 8 x PP 8) beside torchtitan's published figures.

Usage:
  python benchmarks/pp.py

Part 1 (instant): for GPipe, 1F1B, interleaved 1F1B and zero bubble (ZB-H1) at pp = 4 and 8 and
8-32 micro-batches, the bubble of each generated schedule as :func:`fsdpfn.pipeline_times` runs
every rank's list together (a stage forward 1, backward 2, nothing else; zero bubble's split
backward an input half 1 and a weight half 1) against the closed forms (p - 1) / (m + p - 1) for
GPipe and 1F1B, (p - 1) / (v m + p - 1) for interleaved 1F1B with v stages per rank and
(p - 1) / (3 m + p - 1) for zero bubble, and each schedule's peak micro-batches in flight per rank
(GPipe v m, 1F1B p - r, zero bubble p).

Part 2 (about a minute of profiling on meta): Llama 3.1 405B (126 blocks, width 16384, GQA 128/8,
ffn 53248) at 8,192 tokens, micro-batch 1, 32 micro-batches per step, bf16 parameters with float32
reduces, remat="full", AdamW, on ``sim.H100_96GB_500W`` (torchtitan's part), mesh
(pp 8, dp 8, tp 8), 1F1B over 8 stages and interleaved 1F1B over 16, simulated by
:func:`fsdpfn.sim.simulate_pipeline` beside torchtitan's Table 5 (pytorch/torchtitan
benchmarks/llama3_h100_202412_torchtitan.md at 31a17bfd: 1F1B 100 tokens/s/GPU at 82.5 GiB,
interleaved 1F1B 128 at 72.7 GiB; local batch 32, global 256, with torch.compile, Float8 matmuls
and async tp, which the projection does not model).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import sim
from fsdpfn.models import Llama, LlamaConfig

LLAMA31_405B = LlamaConfig(dim=16384, layers=126, heads=128, kv_heads=8, ffn=53248)
TORCHTITAN = {"1f1b": (100, 82.5), "interleaved_1f1b": (128, 72.7)}  # tokens/s/GPU, GiB (Table 5)
LLAMA_TP = {"layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise", "layers.*.attn.wv": "colwise",
            "layers.*.attn.wo": "rowwise", "layers.*.mlp.w1": "colwise", "layers.*.mlp.w3": "colwise",
            "layers.*.mlp.w2": "rowwise"}


def _stages(p: int, v: int) -> fsdpfn.Stages:
    return fsdpfn.Stages(tuple((f"u{s}",) for s in range(p * v)), p)


def bubbles() -> list[float]:
    print("| schedule | pp | stages per rank | micro-batches | bubble (op lists) | closed form | in flight per rank |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for p in (4, 8):
        for m in (8, 16, 32):
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)):
                ps = fsdpfn.pipeline_schedule(_stages(p, v), name, m)
                # zero bubble: backward 2 split into an input and a weight half of 1 each
                t = fsdpfn.pipeline_times(ps, forward=1.0 / v, backward=2.0 / v, backward_input=1.0, backward_weight=1.0)
                # zero bubble idles p - 1 of 3m + p - 1 per rank (see [Note: the zero-bubble schedule])
                closed = (p - 1) / (3 * m + p - 1) if name == "zero_bubble" else (p - 1) / (v * m + p - 1)
                worst = max(worst, abs(t.bubble - closed))
                print(f"| {name} | {p} | {v} | {m} | {t.bubble:.4f} | {closed:.4f} | {', '.join(map(str, t.in_flight))} |")
    print(f"\nlargest |op lists - closed form|: {worst:.2e}; equal to rounding: {worst < 1e-12}")
    return [worst]


def project() -> None:
    hw = sim.H100_96GB_500W
    seq, m = 8192, 32
    mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        model = Llama(LLAMA31_405B)
    units = ["embed"] + [f"layers.{i}" for i in range(LLAMA31_405B.layers)] + ["norm", "output"]
    x = torch.zeros(1, seq, dtype=torch.long, device="meta")
    print(f"\nLlama 3.1 405B on 512 x {hw.name}: pp 8 x dp 8 x tp 8, {seq:,} tokens, micro-batch 1, {m} micro-batches, "
          "bf16 / fp32 reduce, remat='full', AdamW (simulated)\n")
    print("| schedule | stages | step (s) | bubble | peak memory, worst rank (GiB) | tokens/s/GPU | torchtitan | ratio "
          "| torchtitan GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    t0 = time.time()
    wl = None
    for name, stages in (("1f1b", 8), ("interleaved_1f1b", 16)):
        plan = fsdpfn.plan(model, {"pp": 8, "dp": 8, "tp": 8}, units=units, stages=stages, tp=LLAMA_TP, mp=mp, remat="full")
        if wl is None:  # the same units and tp split: one profile serves both splits into stages
            wl = sim.profile(model, plan, x, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1).float(), x.flatten()))
        r = sim.simulate_pipeline(plan, fsdpfn.pipeline_schedule(plan, name, m), wl, sim.AdamW(), hw)
        peak = max(mem["peak"] for mem in r.memory) / 2**30
        tps, gib = TORCHTITAN[name]
        print(f"| {name} | {stages} | {r.step_time:.2f} | {r.times.bubble:.1%} | {peak:.1f} | {r.tokens_per_second:,.0f} | {tps} "
              f"| {r.tokens_per_second / tps:.2f} | {gib} |")
    print(f"\n({time.time() - t0:.0f} s) torchtitan runs torch.compile, Float8 matmuls and async tp; the projection bf16 "
          "without them, with tp collectives blocking")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-project", action="store_true", help="the bubbles only")
    args = p.parse_args(argv)
    print("$ python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])))
    bubbles()
    if not args.no_project:
        project()


if __name__ == "__main__":
    main()
