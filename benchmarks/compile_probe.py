"""Graph-break census: ``torch._dynamo.explain`` of one training step on 2 gloo ranks, for the
pure loop (``fsdpfn.unshard`` inside the loss) and the runtime (``rt.apply`` forward, and a
whole ``loss.backward()`` step), printing the graph and break counts and every break reason
with the line it happened on.

Usage:
  python benchmarks/compile_probe.py                       # zero3, prefetch 1
  python benchmarks/compile_probe.py --strategy zero2 --prefetch 2
"""

from __future__ import annotations

import argparse
import collections
import os
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn.launch import launch
from fsdpfn.models import GPT, GPTConfig


def _census(fn, *args):
    torch._dynamo.reset()
    t = time.perf_counter()
    ex = torch._dynamo.explain(fn)(*args)
    reasons = collections.Counter()
    for b in ex.break_reasons:
        ours = [f for f in b.user_stack or () if "/fsdpfn/" in f.filename]
        where = ours[-1] if ours else (b.user_stack[-1] if b.user_stack else None)  # the library line that broke
        at = f"{os.path.relpath(where.filename)}:{where.lineno} ({where.name})" if where else "?"
        lines = [ln.strip() for ln in str(b.reason).strip().splitlines()]
        detail = next((ln for ln in lines if ln.startswith("Explanation:")), "")
        reasons[(f"{lines[0][:80]}{' / ' + detail[13:120] if detail else ''}", at)] += 1
    return ex.graph_count, ex.graph_break_count, time.perf_counter() - t, sorted(reasons.items(), key=lambda kv: -kv[1])


def _rank(rank, world, strategy, prefetch, depth=2):
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, width=32, depth=depth))
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    plan = fsdpfn.plan(model, mesh, strategy=strategy)
    params = fsdpfn.shard(model, plan, requires_grad=True)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 64, (2, 17), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def ce(logits):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def pure_loss(params, x):
        return ce(torch.func.functional_call(model, fsdpfn.unshard(params, plan), (x,)))

    runtimes = [fsdpfn.runtime.Runtime(model, plan, prefetch=prefetch) for _ in range(2)]

    def runtime_forward(params, x):
        return ce(runtimes[0].apply(params, x))

    def runtime_step(params, x):
        loss = ce(runtimes[1].apply(params, x))
        loss.backward()
        return loss.detach()

    out = {}
    for name, fn in [
        ("pure loop: loss with fsdpfn.unshard", pure_loss),
        ("runtime: rt.apply forward + loss", runtime_forward),
        ("runtime: forward + loss.backward()", runtime_step),
    ]:
        try:
            out[name] = _census(fn, params, x)
        except Exception as e:  # noqa: BLE001 - a census reports, it does not stop
            out[name] = (
                None,
                None,
                0.0,
                [((f"explain failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}", ""), 1)],
            )
        for rt in runtimes:
            rt._ex.abandon()  # a step explain left half done
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--depth", type=int, default=2, help="blocks of the GPT traced (default 2)")
    args = ap.parse_args()
    result = launch(_rank, 2, args.strategy, args.prefetch, args.depth)[0]
    print(f"torch {torch.__version__}, 2 gloo ranks, {args.strategy}, prefetch {args.prefetch}")
    for name, (graphs, breaks, secs, reasons) in result.items():
        print(f"\n{name}: {graphs} graph(s), {breaks} break(s)  [explain {secs:.1f} s]")
        for (reason, at), n in reasons:
            print(f"  {n:3d} x {reason}\n        at {at}")


if __name__ == "__main__":
    main()
