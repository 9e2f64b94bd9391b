"""Memory levers, measured beside the simulator: activation checkpointing (none / full /
save_dots / save_names) and CPU offload on the benchmark GPT (width 512, 4 blocks, vocabulary
4096, sequence 256, batch 4 per rank), 2 gloo ranks, zero3, prefetch 1, ``loss.backward()``.

Per configuration, in one launch, interleaved (A B C ... A B C ...):
- activation memory: the bytes held for backward at the end of the forward, counted (what
  autograd saves, through saved-tensor hooks, each storage once, the unsharded parameters
  left out, plus what rematerialised units keep: ``StepRecord.kept_bytes``), and the simulator's prediction from the same plan
  (``fsdpfn.sim.profile(model, plan, x)``: the sum of the units' activations);
- step time: the median of each round's ratio to the run without any lever, and the simulator's prediction with this
  machine's fitted hardware and the timed profile (``fsdpfn.sim.measure``,
  ``profile(timed=True)``), both as ratios to the run without any lever;
- offload, the optimizer (AdamW) stepping on the host or streamed through the device
  (``fsdpfn.optim.streamed``): bytes copied in and out per step (counted), the device bytes an
  offloaded unit holds between steps (counted: 0), and the step-time ratio beside the
  simulator's (here host and device are one memory, so the host-device link is a memory copy).

Then the same levers projected by the simulator for a Llama-3-8B-like model on 64 H100s.

Usage: python benchmarks/memory_levers.py [--steps 6] [--width 512 --depth 4 --vocab 4096 --seq 256 --batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import sim, testing
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import Runtime, schedule

CONFIGS = {  # name: (plan arguments, optimizer step streamed through the device)
    "none": ({}, False),
    "full": ({"remat": "full"}, False),
    "save_dots": ({"remat": "save_dots"}, False),
    "save_names": ({"remat": "save_names:attention,mlp_up"}, False),
    "offload": ({"offload": True}, False),
    "offload, streamed step": ({"offload": True}, True),
}


def _held_for_backward(model, rt, params, x, y):
    seen, total = set(), [0]

    def pack(t):
        st = t.untyped_storage()
        params = {
            b.untyped_storage()._cdata for bufs in rt._ex.full.values() for b in bufs
        }  # unsharded parameters: not activations
        if st._cdata not in seen and st._cdata not in params:
            seen.add(st._cdata)
            total[0] += st.nbytes()
        return t

    with rt.bind(params), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    held = total[0] + sum(rt.last_step.kept_bytes.values())
    loss.backward()
    return held


def _rank(rank, world, steps, cfg, batch):
    torch.manual_seed(0)
    hw = sim.measure(dtypes=(torch.float32,))
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss_fn = lambda o: F.cross_entropy(o.flatten(0, 1), y.flatten())  # noqa: E731
    mesh = testing.mesh((world,))
    # One timed profile for every lever (profiles timed at different moments of a busy machine
    # would differ by more than the levers do); each plan's remat is applied to it.
    base = fsdpfn.plan(model, mesh)
    names = ("save_names:attention,mlp_up",)
    timed_base = sim.profile(model, base, x, loss_fn=loss_fn, timed=True, repeats=3, remat_policies=names)
    runs = {}
    for name, (kw, streamed) in CONFIGS.items():
        plan = fsdpfn.plan(model, mesh, **kw)
        rt = Runtime(model, plan, prefetch=1)
        params = fsdpfn.shard(model, plan, requires_grad=True)
        opt = fsdpfn.optim.adamw(1e-3)
        opt = fsdpfn.optim.streamed(opt, device="cpu") if streamed else opt
        wl = sim.profile(model, plan, x, loss_fn=loss_fn)
        timed = timed_base.with_remat(plan)
        predicted = sim.simulate(plan, schedule(plan, prefetch=1), timed, sim.AdamW(streamed=streamed), hw).step_time
        runs[name] = dict(
            plan=plan,
            rt=rt,
            params=params,
            opt=opt,
            state=opt.init(params),
            times=[],
            predicted_time=predicted,
            predicted_acts=sum(b for _, b in wl.activations),
        )
    for name, r in runs.items():  # warm-up, and the counted activation bytes
        r["held"] = _held_for_backward(model, r["rt"], r["params"], x, y)
        r["copies"] = sum(b for _, _, b in r["rt"].last_step.copies)
    for _ in range(steps):
        for name, r in runs.items():
            fsdpfn.comm.barrier()
            t0 = time.perf_counter()
            with r["rt"].bind(r["params"]):
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            grads = Runtime.grads(r["params"])
            updates, r["state"] = r["opt"].update(grads, r["state"], r["params"])
            r["params"] = {
                n: p.detach().requires_grad_() for n, p in fsdpfn.optim.apply_updates(r["params"], updates).items()
            }
            r["times"].append(time.perf_counter() - t0)
            r["between"] = sum(r["rt"].memory.offloaded.values())
    return {
        name: {
            k: v
            for k, v in r.items()
            if k in ("times", "predicted_time", "predicted_acts", "held", "copies", "between")
        }
        for name, r in runs.items()
    }


def project(hw: sim.Hardware, gpus: int = 64, seq: int = 8192):
    """Each lever on a Llama-3-8B-like model (meta device) on ``gpus`` ranks of ``hw``, zero3,
    prefetch 1, AdamW: predicted step time, peak memory per rank, host memory per rank."""
    from fsdpfn.models import LLAMA3_8B, Llama

    with torch.device("meta"):
        model = Llama(LLAMA3_8B)
    x = torch.zeros(1, seq, dtype=torch.long, device="meta")
    mp = fsdpfn.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = fsdpfn.plan(model, (gpus,), mp=mp)
    wl = sim.profile(model, base, x, loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1).float(), x.flatten()))
    rows = []
    for name, (kw, streamed) in CONFIGS.items():
        if name == "save_names":  # Llama tags no tensors
            continue
        plan = fsdpfn.plan(model, (gpus,), mp=mp, **kw)
        res = sim.simulate(plan, schedule(plan, prefetch=1), wl.with_remat(plan), sim.AdamW(streamed=streamed), hw)
        rows.append((name, res.step_time, res.memory["reserved"], res.memory.get("host", 0)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="measured steps per configuration, interleaved")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    args = p.parse_args(argv)
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, width=args.width, depth=args.depth, heads=args.heads, bias=False
    )
    res = testing.run_on_ranks(_rank, 2, args.steps, cfg, args.batch, timeout=1800)[0]
    base = res["none"]
    p0 = base["predicted_time"]
    print(
        f"GPT width {args.width}, {args.depth} blocks, seq {args.seq}, batch {args.batch} per rank; 2 gloo ranks, zero3, "
        f"prefetch 1; {args.steps} steps, interleaved\n"
    )
    print(
        "| lever | held for backward (counted) | predicted | activation cut | step time (median) | time ratio, median of rounds [min-max] | "
        "predicted ratio | ratio error | copied per step | device bytes between steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        t = statistics.median(r["times"])
        pairs = [a / b for a, b in zip(r["times"], base["times"])]  # the same round: a slow spell cancels out
        ratio, pred = statistics.median(pairs), r["predicted_time"] / p0
        print(
            f"| {name} | {r['held'] / 2**20:.2f} MiB | {r['predicted_acts'] / 2**20:.2f} MiB | {base['held'] / r['held']:.2f}x | "
            f"{t * 1e3:.0f} ms | {ratio:.2f}x [{min(pairs):.2f}-{max(pairs):.2f}] | {pred:.2f}x | {100 * (pred / ratio - 1):+.0f}% | "
            f"{r['copies'] / 2**20:.2f} MiB | {r['between']} |"
        )
    hw = sim.H100_SXM
    print(
        f"\nProjected with fsdpfn.sim: Llama-3-8B-like, sequence 8192, 1 per rank, 64 x {hw.name}, zero3, prefetch 1, AdamW\n"
    )
    print("| lever | step time | reserved per rank | host per rank |")
    print("|---|---|---|---|")
    for name, t, reserved, host in project(hw):
        print(f"| {name} | {t * 1e3:.0f} ms | {reserved / 2**30:.1f} GiB | {host / 2**30:.1f} GiB |")
    testing.shutdown_pools()


if __name__ == "__main__":
    main(sys.argv[1:])
