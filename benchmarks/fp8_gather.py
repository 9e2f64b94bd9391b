"""MXFP8 parameter all-gather vs a bf16 (or fp32) gather, on 2 gloo ranks.

Three parts, each printing a small table:

1. ``bytes``: every collective of one whole training step (runtime, zero3 with reshard after
   forward, Muon with the owner layout), counted by ``fsdpfn.comm.count_collectives`` for both
   sides on the benchmark model (width 512, 4 blocks, vocabulary 4096, sequence 256), next
   to ``plan.cost()``'s prediction. Bytes do not depend on the batch, so the counted step uses a
   small one (this CPU has no fast bf16 matmul).
2. ``time``: step time FP8 vs high-precision gather, both sides in one launch, interleaved
   (A B, B A, ...), median of the pair-by-pair ratios with the min-max spread; also the gathers
   alone (``fsdpfn.unshard`` of every unit: quantize + all-gather + dequantize vs all-gather).
   bf16 params on a smaller model (width 128, vocabulary 1024, sequence 64: a full-size bf16
   step takes ~70 s on this CPU), fp32 params on the full model.
3. ``loss``: the demo (``examples/train_gpt.py``, 300 steps) with and without ``--fp8``: both
   loss curves on one plot (``docs/fp8_loss.png``) and the gap at steps 100 and 300.

Usage:
  OMP_NUM_THREADS=1 python benchmarks/fp8_gather.py                      # all three
  OMP_NUM_THREADS=1 python benchmarks/fp8_gather.py --parts bytes,time --steps 3 --warmup 1   # smoke run
  python benchmarks/fp8_gather.py --parts loss --runs runs/fp8_off runs/fp8_on   # plot existing demo runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import optim
from fsdpfn.launch import launch
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import Runtime

WORLD = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ce(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _model(width, vocab, seq, depth=4):
    torch.manual_seed(0)
    return GPT(
        GPTConfig(vocab_size=vocab, seq_len=seq, width=width, depth=depth, heads=max(width // 64, 2), bias=False)
    )


def _batch(rank, batch, seq, vocab):
    gen = torch.Generator().manual_seed(rank)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return t[:, :-1], t[:, 1:]


def _mp(param_dtype, fp8):
    return fsdpfn.MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32, fp8="mxfp8" if fp8 else None)


def _mesh():
    return torch.distributed.device_mesh.init_device_mesh("cpu", (WORLD,))


# ---------------------------------------------------------------------------------------------
# 1. Bytes of a whole step, counted
# ---------------------------------------------------------------------------------------------


def _bytes_rank(rank, world, args):
    torch.set_num_threads(1)
    mesh = _mesh()
    model = _model(args.width, args.vocab, args.seq)
    x, y = _batch(rank, 1, 32, args.vocab)
    out = {}
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", None)):
        for fp8 in (False, True):
            plan = fsdpfn.plan(model, mesh, mp=_mp(dtype, fp8))
            params = fsdpfn.shard(model, plan)
            opt = optim.muon(lr=0.02, ns_dtype=torch.float32)
            state = opt.init(params)
            rt = Runtime(model, plan, prefetch=1)
            with fsdpfn.comm.count_collectives() as c:
                grads, _ = rt.value_and_grad(lambda ps: _ce(rt.apply(ps, x), y))(params)
                updates, state = opt.update(grads, state, params)
            per_unit = {}
            for call in c.calls:
                if call.kind == "all_gather":
                    per_unit[call.tag] = per_unit.get(call.tag, 0.0) + call.wire_bytes
            cost = plan.cost(prefetch=1)
            out[(dtype_name, fp8)] = {
                "wire": c.wire_bytes(),
                "calls": c.counts(),
                "per_unit": per_unit,
                "predicted": {k: v.wire_bytes for k, v in cost.collectives.items()},
                "fp8_units": [u.name for u in plan.units if u.fp8],
                "n_fp8": sum(len(u.fp8) for u in plan.units),
            }
    return out


def _report_bytes(r):
    mib = 2.0**20
    print("\n1. Bytes per rank per step (counted; one training step: runtime zero3 + Muon owner layout)")
    print(
        "| gather | all-gather MiB | plan.cost() | reduce-scatter MiB | all-to-all (Muon) MiB | all-reduce MiB | whole step MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for dtype_name in ("bf16", "fp32"):
        for fp8 in (False, True):
            d = r[(dtype_name, fp8)]
            w = d["wire"]
            label = f"{'MXFP8' if fp8 else dtype_name} (params {dtype_name})"
            print(
                f"| {label} | {w.get('all_gather', 0) / mib:.2f} | {d['predicted'].get('all_gather', 0) / mib:.2f} | "
                f"{w.get('reduce_scatter', 0) / mib:.2f} | {w.get('all_to_all', 0) / mib:.2f} | {w.get('all_reduce', 0) / mib:.4f} | "
                f"{sum(w.values()) / mib:.2f} |"
            )
    print("\n| ratio FP8 / high precision | params bf16 | params fp32 |")
    print("|---|---|---|")
    rows = []
    for dtype_name in ("bf16", "fp32"):
        on, off = r[(dtype_name, True)], r[(dtype_name, False)]
        blocks = [u for u in on["fp8_units"] if u]
        unit_ratio = sum(on["per_unit"][u] for u in blocks) / sum(off["per_unit"][u] for u in blocks)
        root_ratio = on["per_unit"].get("", 0) / off["per_unit"][""] if "" in on["per_unit"] else float("nan")
        rows.append(
            (
                unit_ratio,
                root_ratio,
                on["wire"]["all_gather"] / off["wire"]["all_gather"],
                sum(on["wire"].values()) / sum(off["wire"].values()),
            )
        )
    names = [
        "all-gather of the blocks (FP8 units)",
        "all-gather of the root (embeddings stay high precision, head in FP8)",
        "all-gather, whole model",
        "whole step (+ reduce-scatter and Muon, unchanged)",
    ]
    for i, name in enumerate(names):
        print(f"| {name} | {rows[0][i]:.3f} | {rows[1][i]:.3f} |")
    d = r[("bf16", True)]
    same = all(abs(d["wire"].get(k, 0) - d["predicted"].get(k, 0)) < 1e-6 for k in ("all_gather", "reduce_scatter"))
    print(
        f"counted == plan.cost() for all-gather and reduce-scatter: {same}; {d['n_fp8']} FP8 weights; collectives per step "
        f"(FP8): {', '.join(f'{k} {v}' for k, v in sorted(d['calls'].items()))}"
    )


# ---------------------------------------------------------------------------------------------
# 2. Time, interleaved
# ---------------------------------------------------------------------------------------------


class _Side:
    def __init__(self, name, model, mesh, dtype, fp8, lr=1e-3):
        self.name = name
        self.plan = fsdpfn.plan(model, mesh, mp=_mp(dtype, fp8))
        self.params = fsdpfn.shard(model, self.plan)
        self.rt = Runtime(model, self.plan, prefetch=1)
        self.opt = optim.sgd(lr)
        self.state = self.opt.init(self.params)

    def step(self, x, y):
        grads, loss = self.rt.value_and_grad(lambda ps: _ce(self.rt.apply(ps, x), y))(self.params)
        updates, self.state = self.opt.update(grads, self.state, self.params)
        self.params = optim.apply_updates(self.params, updates)
        return loss.item()

    def gather(self, x, y):
        with torch.no_grad():
            fsdpfn.unshard(self.params, self.plan)
        return 0.0


def _interleaved(sides, fn, x, y, steps, warmup):
    for _ in range(warmup):
        for s in sides:
            getattr(s, fn)(x, y)
    times = {s.name: [] for s in sides}
    for i in range(steps):
        for s in sides if i % 2 == 0 else sides[::-1]:
            fsdpfn.comm.barrier()
            t = time.perf_counter()
            getattr(s, fn)(x, y)
            times[s.name].append(time.perf_counter() - t)
    return times


def _time_rank(rank, world, args):
    torch.set_num_threads(1)
    mesh = _mesh()
    out = {}
    configs = [
        ("bf16", torch.bfloat16, args.small_width, args.small_vocab, args.small_seq),
        ("fp32", None, args.width, args.vocab, args.seq),
    ]
    for name, dtype, width, vocab, seq in configs:
        if name not in args.time_configs:
            continue
        model = _model(width, vocab, seq)
        x, y = _batch(rank, args.batch, seq, vocab)
        sides = [_Side("fp8", model, mesh, dtype, True), _Side(name, model, mesh, dtype, False)]
        out[name] = {
            "shape": (width, vocab, seq),
            "step": _interleaved(sides, "step", x, y, args.steps, args.warmup),
            "gather": _interleaved(sides, "gather", x, y, args.steps, args.warmup),
        }
        if rank == 0:
            print(f"  [time {name}: done]", flush=True)
    return out


def _ratio_line(label, times, a, b):
    ratios = [ta / tb for ta, tb in zip(times[a], times[b])]
    return (
        f"| {label} | {statistics.median(times[a]):.3f} s | {statistics.median(times[b]):.3f} s | "
        f"**{statistics.median(ratios):.2f}** [{min(ratios):.2f}-{max(ratios):.2f}] |"
    )


def _report_time(r, args):
    print(
        f"\n2. Time (2 gloo ranks, 1 thread each, {args.steps} interleaved pairs after {args.warmup} warm-up, batch {args.batch}/rank)"
    )
    print("| measured | MXFP8 gather (A) | high-precision gather (B) | A / B, median [min-max] |")
    print("|---|---|---|---|")
    for name, d in r.items():
        w, v, s = d["shape"]
        what = f"params {name}, width {w}, vocab {v}, seq {s}"
        print(_ratio_line(f"training step, {what}", d["step"], "fp8", name))
        print(_ratio_line(f"gathers alone (unshard), {what}", d["gather"], "fp8", name))


# ---------------------------------------------------------------------------------------------
# 3. The demo's loss curve with and without --fp8
# ---------------------------------------------------------------------------------------------


def _run_demo(out_dir, fp8, steps):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "examples", "train_gpt.py"),
        "--no-progress",
        "--steps",
        str(steps),
        "--out",
        out_dir,
    ]
    cmd += ["--fp8"] if fp8 else []
    print("  running:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def _metrics(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    return train, val


def _report_loss(args):
    off_dir, on_dir = args.runs
    for d, fp8 in ((off_dir, False), (on_dir, True)):
        if not os.path.exists(os.path.join(d, "metrics.jsonl")):
            _run_demo(d, fp8, args.demo_steps)
    (off, off_val), (on, on_val) = _metrics(off_dir), _metrics(on_dir)
    last = max(off)
    print(f"\n3. Demo loss (examples/train_gpt.py, {last} steps, 2 ranks, zero3, Muon), without / with --fp8")
    print("| step | loss, fp32 gathers | loss, MXFP8 gathers | gap (MXFP8 - fp32) | validation loss fp32 / MXFP8 |")
    print("|---|---|---|---|---|")
    early = max((k for k in off if k <= last // 3), default=last)  # a short run may log nothing before last // 3
    for step in dict.fromkeys((early, last)):  # steps 100 and 300 of the demo
        s = step
        val = f"{off_val[step]:.4f} / {on_val[step]:.4f}" if step in off_val and step in on_val else ""
        print(f"| {s} | {off[s]:.4f} | {on[s]:.4f} | {on[s] - off[s]:+.4f} | {val} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = sorted(off)
    ax.plot(steps, [off[s] for s in steps], label="fp32 weights gathered (default demo)", lw=1.5)
    steps = sorted(on)
    ax.plot(steps, [on[s] for s in steps], label="MXFP8 weights gathered (--fp8)", lw=1.5, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("examples/train_gpt.py, 2 ranks, zero3, Muon: with and without --fp8")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.plot), exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {os.path.relpath(args.plot, ROOT)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="bytes,time,loss")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--small-width", type=int, default=128)
    ap.add_argument("--small-vocab", type=int, default=1024)
    ap.add_argument("--small-seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank (time part)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--time-configs", default="bf16,fp32", help="bf16 (small model), fp32 (full model)")
    ap.add_argument(
        "--runs",
        nargs=2,
        default=[os.path.join(ROOT, "runs", "fp8_off"), os.path.join(ROOT, "runs", "fp8_on")],
        metavar=("WITHOUT", "WITH"),
        help="demo run directories (run if they hold no metrics)",
    )
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "fp8_loss.png"))
    ap.add_argument(
        "--demo-steps",
        type=int,
        default=300,
        help="steps of the demo runs the loss part starts (when --runs hold none)",
    )
    args = ap.parse_args()
    parts = args.parts.split(",")
    print("command:", "OMP_NUM_THREADS=1 python " + " ".join(sys.argv))
    if "bytes" in parts or "time" in parts:
        print(
            f"model: GPT width {args.width}, 4 blocks, vocab {args.vocab}, seq {args.seq}, no biases; {WORLD} gloo ranks; "
            f"torch {torch.__version__}"
        )
    if "bytes" in parts:
        _report_bytes(launch(_bytes_rank, WORLD, args)[0])
    if "time" in parts:
        _report_time(launch(_time_rank, WORLD, args)[0], args)
    if "loss" in parts:
        _report_loss(args)


if __name__ == "__main__":
    main()
