"""The training stall of a checkpoint: ``fsdpfn.checkpoint.save`` against ``async_save``.

One launch of 2 gloo ranks (one thread each), a GPT sharded zero3 with AdamW state (parameters,
``mu`` and ``nu``: about 0.7 GB in all at the default size, half per rank). The training loop
between saves is a stand-in that costs what a step's update does: an AdamW-shaped elementwise
pass over every parameter and both moments, and one all-reduce on the training process group
(so the background commit's collectives run beside training collectives, on their own group).

For each way, ``--saves`` rounds of: a save of the whole state, then ``--steps`` steps. The stall
is what the training loop waits for per save: the ``save`` call; for ``async_save``, its call,
which stages the shards to host memory and, if the previous save were still being written,
would wait for it first (so a write slower than the steps between saves shows up here). The first
save of each way is a warm-up and not counted. Printed per way: the median stall per save (and
every one), the median step time, and for ``async_save`` the median time to the commit.

Usage:
  python benchmarks/checkpoint.py                  # ~0.7 GB of state, 2 ranks, a few minutes
  python benchmarks/checkpoint.py --functional     # steps that make new tensors, as fsdpfn.optim does
  python benchmarks/checkpoint.py --quick          # a small model, seconds (the tests run it)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fsdpfn  # noqa: E402
from fsdpfn import checkpoint, comm, optim, testing  # noqa: E402
from fsdpfn.models import GPT, GPTConfig  # noqa: E402


def _step(state, in_place):
    """An update's worth of memory traffic over every shard, and one training collective; in
    place, or into new tensors as a functional loop (``fsdpfn.optim``) makes them."""
    params, opt_state = state["params"], state["opt_state"]
    if not in_place:
        with torch.no_grad():
            mu = {n: 0.9 * opt_state.mu[n] + 0.1 * p for n, p in params.items()}
            nu = {n: 0.99 * opt_state.nu[n] + 0.01 * p * p for n, p in params.items()}
            params = {n: p - 1e-6 * mu[n] / (nu[n].sqrt() + 1e-8) for n, p in params.items()}
        comm.all_reduce(torch.ones(1024), tag="training step")
        return {"params": params, "opt_state": opt_state._replace(mu=mu, nu=nu), "step": state["step"] + 1}
    with torch.no_grad():
        for n, p in params.items():
            mu, nu = opt_state.mu[n], opt_state.nu[n]
            mu.to_local().mul_(0.9).add_(p.to_local(), alpha=0.1)
            nu.to_local().mul_(0.99).addcmul_(p.to_local(), p.to_local(), value=0.01)
            p.to_local().sub_(mu.to_local() / (nu.to_local().sqrt() + 1e-8), alpha=1e-6)
    comm.all_reduce(torch.ones(1024), tag="training step")
    return {**state, "step": state["step"] + 1}


def _rank(rank, world, width, depth, saves, steps, root, in_place):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=64, width=width, depth=depth, heads=max(width // 64, 1)))
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params = fsdpfn.init_shards(model, plan, seed=0)
    inner = optim.adamw(1e-3).init(params)
    state = {"params": params, "opt_state": inner, "step": 0}
    local_bytes = sum(
        x.to_local().numel() * x.element_size()
        for x in checkpoint.flatten_state(state)[0].values()
        if isinstance(x, torch.Tensor) and hasattr(x, "to_local")
    )
    out = {"local_bytes": local_bytes}
    for way in ("save", "async_save"):
        stalls, step_times, commits = [], [], []
        target = os.path.join(root, way)
        for i in range(saves + 1):
            comm.barrier(tag="round")
            t0 = time.perf_counter()
            if way == "save":
                checkpoint.save(target, state, plan, keep=2)
            else:
                pending = checkpoint.async_save(target, state, plan, keep=2)
                pending.add_done_callback(lambda _, t0=t0: commits.append(time.perf_counter() - t0))
            stall = time.perf_counter() - t0
            for _ in range(steps):
                t = time.perf_counter()
                state = _step(state, in_place)
                step_times.append(time.perf_counter() - t)
            if i > 0:
                stalls.append(stall)
        checkpoint.wait()
        out[way] = {"stalls": stalls, "step_s": statistics.median(step_times), "commit_s": commits[1:]}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--saves", type=int, default=4, help="measured saves per way (after one warm-up)")
    ap.add_argument("--steps", type=int, default=12, help="training steps between saves")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    ap.add_argument(
        "--functional",
        action="store_true",
        help="steps make new tensors (as fsdpfn.optim does) instead of updating in place: async_save's "
        "stager then allocates a fresh host copy per save instead of refilling the last one",
    )
    ap.add_argument("--quick", action="store_true", help="a small model, 2 saves, 3 steps: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.saves, args.steps = 64, 1, 2, 3
    root = args.dir or tempfile.mkdtemp(prefix="fsdpfn_ckpt_bench_")
    try:
        results = testing.run_on_ranks(
            _rank, 2, args.width, args.depth, args.saves, args.steps, root, not args.functional, timeout=3600
        )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    total = sum(r["local_bytes"] for r in results)
    print(
        f"state: {total / 2**20:.0f} MiB over 2 ranks (width {args.width}, depth {args.depth}, AdamW); "
        f"{args.saves} saves per way, {args.steps} {'functional' if args.functional else 'in-place'} steps between saves"
    )
    # The stall of a save is the slowest rank's: training goes on when every rank is back.
    stall = {
        way: [max(r[way]["stalls"][i] for r in results) for i in range(args.saves)] for way in ("save", "async_save")
    }
    for way in ("save", "async_save"):
        steps = statistics.median(r[way]["step_s"] for r in results)
        line = (
            f"{way:>10}: stall per save {statistics.median(stall[way]):.3f} s (median; "
            f"{', '.join(f'{s:.3f}' for s in stall[way])}), step {steps * 1e3:.0f} ms"
        )
        if way == "async_save":
            commits = [c for r in results for c in r[way]["commit_s"]]
            line += f", commit {statistics.median(commits):.2f} s after the call" if commits else ""
        print(line)
    ratio = statistics.median(stall["async_save"]) / statistics.median(stall["save"])
    print(f"async/sync stall ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
