"""Memory levers, measured beside the simulator: activation checkpointing (none / full /
save_dots / save_names) and CPU offload on the benchmark GPT (width 512, 4 blocks, vocabulary
4096, sequence 256, batch 4 per rank), 2 gloo ranks, zero3, prefetch 1, ``loss.backward()``.

Per configuration, in one launch, interleaved (A B C ... A B C ...):
- activation memory: the bytes held for backward at the end of the forward, counted (what
  autograd saves, through saved-tensor hooks, each storage once, the unsharded parameters
  left out, plus what rematerialised units keep: ``StepRecord.kept_bytes``), and the simulator's prediction from the same plan
  (``fsdpfn.sim.profile(model, plan, x)``: the sum of the units' activations);
- step time: the median over the measured steps, and the simulator's prediction with this
  machine's fitted hardware and the timed profile (``fsdpfn.sim.measure``,
  ``profile(timed=True)``), both as ratios to the run without any lever;
- offload: bytes copied in and out per step (counted), the device bytes an offloaded unit holds
  between steps (counted: 0), and the step-time ratio. The simulator does not cost host copies,
  so its offload column is the same as "none".

Usage: python benchmarks/memory_levers.py [--steps 6]
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

CONFIGS = {
    "none": {},
    "full": {"remat": "full"},
    "save_dots": {"remat": "save_dots"},
    "save_names": {"remat": "save_names:attention,mlp_up"},
    "offload": {"offload": True},
}


def _held_for_backward(model, rt, params, x, y):
    seen, total = set(), [0]

    def pack(t):
        st = t.untyped_storage()
        params = {b.untyped_storage()._cdata for bufs in rt._ex.full.values() for b in bufs}  # unsharded parameters: not activations
        if st._cdata not in seen and st._cdata not in params:
            seen.add(st._cdata)
            total[0] += st.nbytes()
        return t

    with rt.bind(params), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    held = total[0] + sum(rt.last_step.kept_bytes.values())
    loss.backward()
    return held


def _rank(rank, world, steps):
    torch.manual_seed(0)
    hw = sim.measure(dtypes=(torch.float32,))
    cfg = GPTConfig(vocab_size=4096, seq_len=256, width=512, depth=4, heads=8, bias=False)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss_fn = lambda o: F.cross_entropy(o.flatten(0, 1), y.flatten())  # noqa: E731
    mesh = testing.mesh((world,))
    runs = {}
    for name, kw in CONFIGS.items():
        plan = fsdpfn.plan(model, mesh, **kw)
        rt = Runtime(model, plan, prefetch=1)
        params = fsdpfn.shard(model, plan, requires_grad=True)
        wl = sim.profile(model, plan, x, loss_fn=loss_fn)
        timed = sim.profile(model, plan, x, loss_fn=loss_fn, timed=True, repeats=2)
        predicted = sim.simulate(plan, schedule(plan, prefetch=1), timed, None, hw).step_time
        runs[name] = dict(plan=plan, rt=rt, params=params, times=[], predicted_time=predicted,
                          predicted_acts=sum(b for _, b in wl.activations))
    for name, r in runs.items():  # warm-up, and the counted activation bytes
        r["held"] = _held_for_backward(model, r["rt"], r["params"], x, y)
        r["copies"] = sum(b for _, _, b in r["rt"].last_step.copies)
    for _ in range(steps):
        for name, r in runs.items():
            fsdpfn.comm.barrier()
            t0 = time.perf_counter()
            with r["rt"].bind(r["params"]):
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            r["times"].append(time.perf_counter() - t0)
            r["between"] = sum(r["rt"].memory.offloaded.values())
            for p in r["params"].values():
                p.grad = None
    return {name: {k: v for k, v in r.items() if k not in ("plan", "rt", "params")} for name, r in runs.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="measured steps per configuration, interleaved")
    args = p.parse_args(argv)
    res = testing.run_on_ranks(_rank, 2, args.steps, timeout=1800)[0]
    base = res["none"]
    t0, p0 = statistics.median(base["times"]), base["predicted_time"]
    print(f"GPT width 512, 4 blocks, seq 256, batch 4 per rank; 2 gloo ranks, zero3, prefetch 1; {args.steps} steps, interleaved\n")
    print("| lever | held for backward (counted) | predicted | activation cut | step time (median) | time ratio | "
          "predicted ratio | ratio error | copied per step | device bytes between steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        t = statistics.median(r["times"])
        ratio, pred = t / t0, r["predicted_time"] / p0
        print(f"| {name} | {r['held'] / 2**20:.2f} MiB | {r['predicted_acts'] / 2**20:.2f} MiB | {base['held'] / r['held']:.2f}x | "
              f"{t * 1e3:.0f} ms | {ratio:.2f}x | {pred:.2f}x | {100 * (pred / ratio - 1):+.0f}% | "
              f"{r['copies'] / 2**20:.2f} MiB | {r['between']} |")
    testing.shutdown_pools()


if __name__ == "__main__":
    main(sys.argv[1:])
