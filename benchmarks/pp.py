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

Part 2 (about a minute, 2 gloo ranks): the same four schedules run by
:class:`fsdpfn.runtime.PipelineRuntime` on pp = 2 (a GPT of width 256, 4 blocks, 128 tokens per
sequence, 8 micro-batches of 2 sequences), ``profile=True``: each rank's measured bubble (the
fraction of its step outside stage forwards and backwards) beside what :func:`fsdpfn.pipeline_times`
gives for the same op lists priced with the forward and backward times measured per stage (so
the difference is what the schedule model leaves out: transfers, FSDP ops, the two ranks sharing
2 cores with gloo's threads), and each rank's peak activation bytes against the op lists' count
priced with the bytes one micro-batch's forward keeps (equal when the runtime frees exactly when
the schedule says).

Part 3 (about a minute of profiling on meta): Llama 3.1 405B (126 blocks, width 16384, GQA 128/8,
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
LLAMA_TP = {
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.mlp.w1": "colwise",
    "layers.*.mlp.w3": "colwise",
    "layers.*.mlp.w2": "rowwise",
}


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
                t = fsdpfn.pipeline_times(
                    ps, forward=1.0 / v, backward=2.0 / v, backward_input=1.0, backward_weight=1.0
                )
                # zero bubble idles p - 1 of 3m + p - 1 per rank (see [Note: the zero-bubble schedule])
                closed = (p - 1) / (3 * m + p - 1) if name == "zero_bubble" else (p - 1) / (v * m + p - 1)
                worst = max(worst, abs(t.bubble - closed))
                print(
                    f"| {name} | {p} | {v} | {m} | {t.bubble:.4f} | {closed:.4f} | {', '.join(map(str, t.in_flight))} |"
                )
    print(f"\nlargest |op lists - closed form|: {worst:.2e}; equal to rounding: {worst < 1e-12}")
    return [worst]


MEASURE_CFG = dict(vocab_size=64, seq_len=128, width=256, depth=4, heads=4)
MEASURE_UNITS = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]


def _measure(rank, world, name, micro, per_micro, steps, measure_cfg=MEASURE_CFG):
    """One pp rank: ``steps`` profiled steps of ``name`` (the first one a warm-up, dropped)."""
    from fsdpfn import testing
    from fsdpfn.models import GPT, GPTConfig
    from fsdpfn.runtime import PipelineRuntime

    torch.set_num_threads(1)  # two ranks on two cores
    torch.manual_seed(0)
    cfg = GPTConfig(**measure_cfg)
    model = GPT(cfg)
    plan = fsdpfn.pipeline_plan(
        model, testing.mesh((2, 1), ("pp", "dp")), units=MEASURE_UNITS, stages=4 if name == "interleaved_1f1b" else 2
    )
    ce = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    pipe = PipelineRuntime(model, plan, name, micro, loss_fn=ce, profile=True)
    params = pipe.shard(model)
    tokens = torch.randint(
        0, cfg.vocab_size, (micro * per_micro, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    out = []
    for _ in range(steps):
        pipe.step(params, tokens[:, :-1], tokens[:, 1:])
        out.append(pipe.last_profile)
    return out[1:], str(plan.fingerprint)


def _stage_of(op: str) -> int:
    return int(op.split()[1][1:])


def measured(
    micro: int = 8,
    per_micro: int = 2,
    steps: int = 4,
    width: int = MEASURE_CFG["width"],
    seq_len: int = MEASURE_CFG["seq_len"],
) -> list[float]:
    """Part 2: measured bubbles and peak activations on 2 gloo ranks against the op lists."""
    from fsdpfn.testing import run_on_ranks

    measure_cfg = {**MEASURE_CFG, "width": width, "seq_len": seq_len}

    print(
        f"\nMeasured on 2 gloo ranks (pp 2, dp 1; GPT width {measure_cfg['width']}, {measure_cfg['depth']} blocks, "
        f"{measure_cfg['seq_len']} tokens, {micro} micro-batches of {per_micro}; median of {steps - 1} steps):\n"
    )
    print(
        "| schedule | rank | step (ms) | measured bubble | op lists with measured f, b | closed form (f = b / 2) "
        "| peak activations (MiB) | op lists' count x bytes | equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    worst_memory = 0.0
    backward: dict[str, list] = {}  # 1F1B's backward and zero bubble's halves, per stage
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"):
        ranks = run_on_ranks(_measure, 2, name, micro, per_micro, steps, measure_cfg, timeout=600)
        v = 2 if name == "interleaved_1f1b" else 1
        stages = fsdpfn.Stages(tuple((f"u{s}",) for s in range(2 * v)), 2)
        ps = fsdpfn.pipeline_schedule(stages, name, micro)
        # per stage: median forward and backward (halves) seconds, and one micro-batch's bytes
        times: dict[tuple[str, int], list[float]] = {}
        acts: dict[int, int] = {}
        for profiles, _ in ranks:
            for prof in profiles:
                for op, start, end in prof.timeline:
                    if op.startswith("stage_"):
                        times.setdefault((op.split()[0], _stage_of(op)), []).append(end - start)
                for s, _, nbytes in prof.activations:
                    acts[s] = max(acts.get(s, 0), nbytes)
        med = {k: sorted(x)[len(x) // 2] for k, x in times.items()}
        n = 2 * v
        f = [med[("stage_forward", s)] for s in range(n)]
        kw: dict = {}
        if name == "zero_bubble":
            bi = [med[("stage_backward_input", s)] for s in range(n)]
            bw = [med[("stage_backward_weight", s)] for s in range(n)]
            kw = dict(backward=[a + b for a, b in zip(bi, bw)], backward_input=bi, backward_weight=bw)
            backward[name] = list(zip(bi, bw))
        else:
            kw = dict(backward=[med[("stage_backward", s)] for s in range(n)])
            backward[name] = kw["backward"]
        model = fsdpfn.pipeline_times(ps, forward=f, activations=[acts[s] for s in range(n)], **kw)
        closed = fsdpfn.pipeline_times(ps, forward=1.0 / v, backward=2.0 / v, backward_input=1.0, backward_weight=1.0)
        for r, (profiles, _) in enumerate(ranks):
            bubble = sorted(p.bubble for p in profiles)[len(profiles) // 2]
            span = sorted(p.makespan for p in profiles)[len(profiles) // 2]
            idle = 1 - model.busy[r] / model.makespan
            closed_idle = 1 - closed.busy[r] / closed.makespan
            peak = max(p.peak_activations for p in profiles)
            want = model.peak_activations[r]
            worst_memory = max(worst_memory, abs(peak - want) / want)
            print(
                f"| {name} | {r} | {span * 1e3:.0f} | {bubble:.3f} | {idle:.3f} | {closed_idle:.3f} | {peak / 2**20:.2f} | "
                f"{want / 2**20:.2f} | {peak == want} |"
            )
    print(f"\nlargest |measured - op lists| peak activations: {worst_memory:.1%}")
    if "1f1b" in backward and "zero_bubble" in backward:
        # The weight half starts where the input half left the weights' paths, so the two halves
        # together are one backward (stage 0's input is the tokens: its weight half is the whole one).
        print(
            "zero bubble's halves (input + weight) / 1F1B's backward, per stage: "
            + ", ".join(
                f"stage {s}: ({bi * 1e3:.1f} + {bw * 1e3:.1f}) / {b * 1e3:.1f} ms = {(bi + bw) / b:.2f}"
                for s, ((bi, bw), b) in enumerate(zip(backward["zero_bubble"], backward["1f1b"]))
            )
        )
    return [worst_memory]


def project() -> None:
    hw = sim.H100_96GB_500W
    seq, m = 8192, 32
    mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with torch.device("meta"):
        model = Llama(LLAMA31_405B)
    units = ["embed"] + [f"layers.{i}" for i in range(LLAMA31_405B.layers)] + ["norm", "output"]
    x = torch.zeros(1, seq, dtype=torch.long, device="meta")
    print(
        f"\nLlama 3.1 405B on 512 x {hw.name}: pp 8 x dp 8 x tp 8, {seq:,} tokens, micro-batch 1, {m} micro-batches, "
        "bf16 / fp32 reduce, remat='full', AdamW (simulated)\n"
    )
    print(
        "| schedule | stages | step (s) | bubble | peak memory, worst rank (GiB) | tokens/s/GPU | torchtitan | ratio "
        "| torchtitan GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    t0 = time.time()
    wl = None
    for name, stages in (("1f1b", 8), ("interleaved_1f1b", 16)):
        plan = fsdpfn.pipeline_plan(
            model, {"pp": 8, "dp": 8, "tp": 8}, units=units, stages=stages, tp=LLAMA_TP, mp=mp, remat="full"
        )
        if wl is None:  # the same units and tp split: one profile serves both splits into stages
            wl = sim.profile(
                model, plan, x, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1).float(), x.flatten())
            )
        r = sim.simulate_pipeline(plan, fsdpfn.pipeline_schedule(plan, name, m), wl, sim.AdamW(), hw)
        peak = max(mem["peak"] for mem in r.memory) / 2**30
        tps, gib = TORCHTITAN[name]
        print(
            f"| {name} | {stages} | {r.step_time:.2f} | {r.times.bubble:.1%} | {peak:.1f} | {r.tokens_per_second:,.0f} | {tps} "
            f"| {r.tokens_per_second / tps:.2f} | {gib} |"
        )
    print(
        f"\n({time.time() - t0:.0f} s) torchtitan runs torch.compile, Float8 matmuls and async tp; the projection bf16 "
        "without them, with tp collectives blocking"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-project", action="store_true", help="no 405B projection")
    p.add_argument("--no-measure", action="store_true", help="no measured run on gloo ranks")
    p.add_argument(
        "--measure-steps", type=int, default=4, help="steps per schedule on gloo ranks (the first a warm-up)"
    )
    p.add_argument(
        "--measure-width",
        type=int,
        default=MEASURE_CFG["width"],
        help=f"width of the GPT measured on gloo ranks (default {MEASURE_CFG['width']}; a multiple of its "
        f"{MEASURE_CFG['heads']} heads)",
    )
    p.add_argument(
        "--measure-seq",
        type=int,
        default=MEASURE_CFG["seq_len"],
        help=f"tokens per sequence of the GPT measured on gloo ranks (default {MEASURE_CFG['seq_len']})",
    )
    args = p.parse_args(argv)
    if args.measure_steps < 2:
        p.error(f"--measure-steps must be >= 2 (a warm-up, then measured steps), got {args.measure_steps}")
    print("$ python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])))
    bubbles()
    if not args.no_measure:
        measured(steps=args.measure_steps, width=args.measure_width, seq_len=args.measure_seq)
    if not args.no_project:
        project()


if __name__ == "__main__":
    main()
