"""inductor's FX bucketing passes on fsdpfn's compiled step: ``fsdpfn.compile(loss_fn, bucket=True)``
against ``bucket=False``, both compiled in one launch on 2 gloo ranks, zero3, then timed
interleaved (each side first in turn). Prints the collectives each compiled graph holds (kind and
bytes, as ``step.collectives`` lists them), the compile time, and the median [min-max] of the
pair-by-pair step-time ratios.

Usage:
  OMP_NUM_THREADS=1 python benchmarks/compile_bucket.py [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import testing
from fsdpfn.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=512, seq_len=64, width=128, depth=4, heads=4)


def _rank(rank, world, steps):
    warnings.simplefilter("ignore")  # dynamo's and inductor's own warnings
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join("/tmp", f"fsdpfn-bench-inductor-{cap}")
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params = fsdpfn.shard(model, plan)

    def loss_fn(p, x, y):
        return F.cross_entropy(
            torch.func.functional_call(model, fsdpfn.unshard(p, plan), (x,)).flatten(0, 1), y.flatten()
        )

    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    x, y = tokens[:, :-1], tokens[:, 1:]
    sides = {b: fsdpfn.compile(loss_fn, bucket=b) for b in (False, True)}
    first = {}
    for b, step in sides.items():
        t = time.perf_counter()
        step(params, x, y)
        first[b] = time.perf_counter() - t
    ratios = []
    for i in range(steps):
        t_side = {}
        for b in (False, True) if i % 2 else (True, False):
            torch.distributed.barrier()
            t = time.perf_counter()
            step = sides[b]
            step(params, x, y)
            t_side[b] = time.perf_counter() - t
        ratios.append(t_side[True] / t_side[False])
    return first, ratios, {b: [(c.kind, c.nbytes) for c in s.collectives] for b, s in sides.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    res = testing.run_on_ranks(_rank, 2, args.steps, timeout=3600)
    first, _, calls = res[0]
    ratios = [max(r[1][i] for r in res) for i in range(args.steps)]
    for b, name in ((False, "bucket=False"), (True, "bucket=True")):
        kinds = {}
        for kind, nbytes in calls[b]:
            n, total = kinds.get(kind, (0, 0))
            kinds[kind] = (n + 1, total + nbytes)
        desc = ", ".join(f"{n} {k} ({total / 2**20:.2f} MiB)" for k, (n, total) in kinds.items())
        print(f"{name}: compile {first[b]:.0f} s; collectives per step: {desc}")
    print(
        f"step time, bucket=True / bucket=False: {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
    )


if __name__ == "__main__":
    main()
