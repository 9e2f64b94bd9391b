"""What the differential check costs: the first step of ``Runtime(model, plan, verify=True)``
(the check, then the step) against the first step of ``Runtime(model, plan, verify=False)``, on
a small GPT (fsdpfn.models.GPT) over gloo ranks, per mesh: (dp, tp), (dp, cp) and (ep, edp)
(GPTConfig(experts=4)).

Time: each repeat builds a fresh Runtime (the check runs on a runtime's first step) and times its
first forward and backward (``rt.value_and_grad``), checked and plain alternately, after one
warm-up step of each; the table gives the median over ``--repeats`` and the ratio (target: at
most 3x). Every rank's time is the slowest rank's (a barrier before and a max after).

Memory: the growth of the process's peak resident set (``ru_maxrss``) over a checked first step,
measured after the plain steps have set the peak a step reaches: what the check holds beyond a
plain step (the allocator's reuse makes it a lower bound of what the check allocates, in KiB
pages; the max over ranks is shown, and the growth over a second plain step beside it is the
measure's noise). Beside it, the largest unit's full parameters plus its input and output over
the whole sequences ("unit KiB"), a floor of what the check holds: it also keeps one unit's
internal activations for its two VJPs (sharded and unsharded), which are not counted there.

Usage:
  python benchmarks/verify.py                      # about a minute on 2 cores
  python benchmarks/verify.py --width 64 --seq 64 --repeats 1 --meshes dp_tp
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fsdpfn  # noqa: E402
from fsdpfn import comm, testing  # noqa: E402
from fsdpfn.models import GPT, GPT_TP_PLAN, GPTConfig  # noqa: E402
from fsdpfn.runtime import Runtime  # noqa: E402

MESHES = {  # name: (shape, dim names, experts)
    "dp_tp": ((1, 2), ("dp", "tp"), 0),
    "dp_cp": ((1, 2), ("dp", "cp"), 0),
    "ep": ((2, 1), ("ep", "edp"), 4),
}


def _loss(out, y):
    logits, aux = out if isinstance(out, tuple) else (out, 0.0)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + aux


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _rank(rank, world, name, args):
    shape, names, experts = MESHES[name]
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        bias=False,
        experts=experts,
        capacity_factor=None,
    )
    mesh = testing.mesh(shape, names)
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, mesh, tp=GPT_TP_PLAN if "tp" in names else None)
    params = fsdpfn.shard(model, plan)
    gen = torch.Generator().manual_seed(1 + fsdpfn.transforms.dp_rank(plan))
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    cp = plan.cp_size > 1
    if cp:
        x, y = fsdpfn.context_parallel_shard((x, y), plan)

    def first_step(verify: bool) -> float:
        rt = Runtime(model, plan, verify=verify)
        comm.barrier()
        t = time.perf_counter()
        if cp:
            with fsdpfn.context_parallel(plan):
                rt.value_and_grad(lambda ps: _loss(rt.apply(ps, x), y))(params)
        else:
            rt.value_and_grad(lambda ps: _loss(rt.apply(ps, x), y))(params)
        elapsed = torch.tensor([time.perf_counter() - t])
        comm.all_reduce(elapsed, op="max")
        return float(elapsed)

    first_step(False)
    base = _maxrss_kib()
    first_step(False)
    plain_growth = _maxrss_kib() - base
    before = _maxrss_kib()
    first_step(True)
    checked_growth = _maxrss_kib() - before
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for verify in (False, True):
            times[verify].append(first_step(verify))
    growth = torch.tensor([float(plain_growth), float(checked_growth)])
    comm.all_reduce(growth, op="max")
    # One unit's full parameters and one unit's full-sequence activations (fp32; the unit's input
    # and output over the whole batch's sequences), the memory the check aims to stay within.
    unit_params = max(sum(p.numel for p in u.params) for u in plan.units if u.name) * 4
    acts = 2 * args.batch * args.seq * args.width * 4
    return dict(
        mesh=name,
        plain=statistics.median(times[False]),
        checked=statistics.median(times[True]),
        plain_kib=growth[0].item(),
        checked_kib=growth[1].item(),
        unit_kib=(unit_params + acts) / 1024,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--meshes", default=",".join(MESHES), help=f"comma-separated, of {', '.join(MESHES)}")
    args = ap.parse_args(argv)
    rows = []
    for name in args.meshes.split(","):
        shape = MESHES[name][0]
        rows.append(testing.run_on_ranks(_rank, shape[0] * shape[1], name, args)[0])
    testing.shutdown_pools()
    print(f"$ python benchmarks/verify.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(
        f"GPT width {args.width}, depth {args.depth}, heads {args.heads}, vocab {args.vocab}, seq {args.seq}, batch "
        f"{args.batch} per dp rank, fp32, zero3; first step of a fresh Runtime, median of {args.repeats}, 2 gloo ranks"
    )
    print(
        f"{'mesh':<8} {'plain s':>9} {'checked s':>10} {'ratio':>6} {'peak RSS +KiB plain':>20} {'checked':>8} "
        f"{'unit KiB':>9}"
    )
    for r in rows:
        print(
            f"{r['mesh']:<8} {r['plain']:>9.3f} {r['checked']:>10.3f} {r['checked'] / r['plain']:>6.2f} "
            f"{r['plain_kib']:>20.0f} {r['checked_kib']:>8.0f} {r['unit_kib']:>9.0f}"
        )
    return rows


if __name__ == "__main__":
    main()
