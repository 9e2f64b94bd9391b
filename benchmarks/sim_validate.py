"""Validates ``fsdpfn.sim`` on real runs: predicted vs measured step time and peak unsharded
memory, for strategies x world sizes x prefetch depths x optimizers, on gloo CPU ranks.

Per world size, one launch: every rank first fits the hardware (``fsdpfn.sim.measure()``), then
runs every configuration's training steps interleaved (round-robin, the rule of
docs/benchmarks.md: same machine state for all of them), and reports the median step (the slowest rank's time of
forward, backward, optimizer update and ``apply_updates``) and the runtime's own high-water
mark of unsharded bytes. The simulator gets the plan, the runtime's schedule, a workload
profiled on the real module (``fsdpfn.sim.profile``), the optimizer and the measured hardware.
The collectives each configuration issued in one step (``fsdpfn.comm.count_collectives``) are
compared with the simulator's per-kind calls and bytes too: "bytes" says whether they agree
exactly.

Model: GPT width 256, 4 blocks, vocabulary 2048, sequence 128, batch 4 per rank by default:
an eighth of the benchmark model's FLOPs (width 512, vocab 4096, seq 256), so that the whole grid
(4 strategies + HSDP x 3 world sizes x 3 prefetch depths x 2 optimizers, interleaved, on two
shared cores) runs in 9 minutes; ``--width 512 --vocab 4096 --seq 256 --steps 5`` runs the
benchmark model (about 30 minutes: 6.5 at W=2, 10 at W=3, 14 at W=4). Muon runs Newton-Schulz in fp32 (``--ns-dtype``): this CPU has no
fast bf16 matmul.

Every configuration of a world size stays alive through its rounds (that is what interleaving
needs), so memory grows with the grid: with the benchmark model at W=4 (4 ranks in 24 GiB) run
one optimizer at a time (``--optimizers adamw``, then ``--optimizers muon``).

Usage:
  OMP_NUM_THREADS=1 python benchmarks/sim_validate.py
  OMP_NUM_THREADS=1 python benchmarks/sim_validate.py --width 512 --vocab 4096 --seq 256 --steps 5   # the benchmark model
  OMP_NUM_THREADS=1 python benchmarks/sim_validate.py --search-check      # the search's pick against the default, run
  OMP_NUM_THREADS=1 python benchmarks/sim_validate.py --world-sizes 2 --strategies zero3 --steps 5   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F

import fsdpfn
from fsdpfn import comm, optim, sim, testing
from fsdpfn.launch import launch
from fsdpfn.models import GPT, GPTConfig
from fsdpfn.runtime import Runtime


def _configs(args, w):
    out = []
    for strategy in args.strategies:
        if strategy == "local":  # a reference: no sharding, no runtime, no communication
            for opt in args.optimizers:
                out.append(("local", (1,), "zero3", 0, opt))
            continue
        elif strategy.startswith("hsdp"):
            if w % 2 or w < 4:
                continue
            mesh = (2, w // 2)
            strat = "zero3"
        else:
            mesh, strat = (w,), strategy
        for prefetch in args.prefetch:
            for opt in args.optimizers:
                out.append((strategy, mesh, strat, prefetch, opt))
    return out


def _opt(name, ns_dtype):
    if name == "adamw":
        return optim.adamw(1e-3, weight_decay=0.1), sim.AdamW()
    layout = name.split(":")[1] if ":" in name else "owner"
    return (optim.muon(0.02, layout=layout, ns_dtype=ns_dtype), sim.Muon(layout=layout, ns_dtype=ns_dtype))


def _max_over_ranks(t: float) -> float:
    buf = torch.tensor([t], dtype=torch.float64)
    comm.all_reduce(buf, op="max").wait()
    return buf.item()


def _workloads(model, plan, x, y, timed_compute):
    """``(model, timed)``: the workload costed by FLOPs and bytes, and (``timed_compute``) the
    same with every stretch's compute timed here, on all ranks at once (as the steps run), the
    slowest rank's."""
    loss_fn = lambda o: F.cross_entropy(o.flatten(0, 1), y.flatten())  # noqa: E731
    wl = sim.profile(model, plan, x, loss_fn=loss_fn)
    if not timed_compute:
        return wl, None
    comm.barrier()
    timed = sim.profile(model, plan, x, loss_fn=loss_fn, timed=True, repeats=3)
    per_rank = comm.all_gather_object([w.measured for _, w in timed.work])
    slowest = [max(m) if None not in m else None for m in zip(*per_rank)]
    work = tuple((e, dataclasses.replace(w, measured=m)) for (e, w), m in zip(timed.work, slowest))
    return wl, dataclasses.replace(timed, work=work)


def _model_and_batch(rank, args):
    """The GPT of the command line and this rank's batch ``(x, y)``."""
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, width=args.width, depth=args.depth, heads=args.heads, bias=False
    )
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=gen)
    return GPT(cfg), tokens[:, :-1], tokens[:, 1:]


def _rank(rank, world, args):
    torch.manual_seed(0)
    probes = [sim.measure_timings(dtypes=(torch.float32,))]
    model, x, y = _model_and_batch(rank, args)
    ns_dtype = getattr(torch, args.ns_dtype)
    runs = []
    workloads = {}
    for name, mesh_shape, strat, prefetch, opt_name in _configs(args, world):
        names = ("replicate", "shard") if len(mesh_shape) == 2 else None
        if name == "local":  # no sharding, no runtime: this rank's own model, as a reference
            plan = fsdpfn.plan(model, (1,))
            rt = None
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            mesh = testing.mesh(mesh_shape, names) if names else testing.mesh(mesh_shape)
            plan = fsdpfn.plan(model, mesh, strategy=strat)
            rt = Runtime(model, plan, prefetch=prefetch)
            params = fsdpfn.shard(model, plan)
        opt, opt_model = _opt(opt_name, ns_dtype)
        key = tuple(u.name for u in plan.units)
        if key not in workloads:
            workloads[key] = _workloads(model, plan, x, y, args.timed_compute)
        runs.append(
            dict(
                name=name,
                mesh=mesh_shape,
                prefetch=prefetch,
                opt=opt_name,
                plan=plan,
                rt=rt,
                params=params,
                opt_fn=opt,
                opt_model=opt_model,
                state=opt.init(params),
                times=[],
                opt_times=[],
                hw=0,
                wl=workloads[key],
            )
        )

    def step(r):
        rt = r["rt"]

        def loss_fn(ps, x, y):
            logits = torch.func.functional_call(model, ps, (x,)) if rt is None else rt.apply(ps, x)
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        grads, _ = torch.func.grad_and_value(loss_fn)(r["params"], x, y)
        t_fb = time.perf_counter()
        updates, r["state"] = r["opt_fn"].update(grads, r["state"], r["params"])
        r["params"] = optim.apply_updates(r["params"], updates)
        return t_fb

    for r in runs:  # one counted step each (also a warm-up)
        if r["rt"] is not None:
            r["rt"].memory.reset()
        with comm.count_collectives() as c:
            step(r)
        r["counted"] = {k: (c.counts()[k], c.nbytes()[k]) for k in c.counts()}
        r["hw"] = r["rt"].memory.high_water if r["rt"] is not None else None
    for i in range(args.warmup + args.steps):
        for r in runs:
            comm.barrier()
            t0 = time.perf_counter()
            t_fb = step(r)
            t1 = time.perf_counter()
            t, t_opt = _max_over_ranks(t1 - t0), _max_over_ranks(t1 - t_fb)
            if i >= args.warmup:
                r["times"].append(t)
                r["opt_times"].append(t_opt)
        # The hardware, timed between the rounds: it sees the machine as the steps did.
        probes.append(sim.measure_timings(dtypes=(torch.float32,), repeats=args.probe_repeats))
    hw = sim.fit_hardware(probes, name=f"this machine, {world} gloo ranks", stat=args.stat)
    if rank != 0:
        return None
    rows = []
    for r in runs:
        sched = r["rt"].schedule if r["rt"] is not None else None
        res = sim.simulate(r["plan"], sched, r["wl"][0], r["opt_model"], hw)
        res_m = sim.simulate(r["plan"], sched, r["wl"][1], r["opt_model"], hw) if r["wl"][1] is not None else res
        predicted = {k: (t.calls, t.nbytes) for k, t in res.collectives.items()}
        if r["rt"] is None:  # the reference: no runtime (no copies, no collectives), the compute alone
            predicted, r["counted"] = {}, {}
            opt_s = sum(p.seconds(hw) for p in r["opt_model"].cost(r["plan"]).phases if isinstance(p, sim.Work))
            fb_s = sum(w.seconds(hw) for _, w in r["wl"][0].work)
            res = dataclasses.replace(
                res, step_time=fb_s + opt_s, optimizer_time=opt_s, memory={**res.memory, "unsharded_peak": None}
            )
            res_m = res
        rows.append(
            dict(
                world=world,
                name=r["name"],
                mesh=r["mesh"],
                prefetch=r["prefetch"],
                opt=r["opt"],
                pred=res.step_time,
                pred_m=res_m.step_time,
                pred_opt=res.optimizer_time,
                times=r["times"],
                opt_times=r["opt_times"],
                pred_hw=res.memory["unsharded_peak"],
                hw=r["hw"],
                bytes_ok=predicted == r["counted"],
                compute=res.compute_time,
                exposed=res.exposed_comm,
                counted=r["counted"],
                predicted=predicted,
                summary=res.summary() if args.explain else "",
            )
        )
    return rows, str(hw)


def _search_rank(rank, world, args):
    """Fits the hardware, searches a plan for this machine under the budget, then runs the pick
    and the default plan (zero3, prefetch 1) interleaved."""
    torch.manual_seed(0)
    probes = [sim.measure_timings(dtypes=(torch.float32,)) for _ in range(2)]
    hw = sim.fit_hardware(probes, name=f"this machine, {world} gloo ranks", stat=args.stat)
    model, x, y = _model_and_batch(rank, args)
    ns_dtype = getattr(torch, args.ns_dtype)
    opt_name = args.optimizers[0]
    _, opt_model = _opt(opt_name, ns_dtype)
    loss_fn = lambda o: F.cross_entropy(o.flatten(0, 1), y.flatten())  # noqa: E731
    t0 = time.perf_counter()
    res = sim.search(model, world, args.search_budget_mib * 2**20, x, hardware=hw, optimizer=opt_model, loss_fn=loss_fn)
    search_s = time.perf_counter() - t0
    sides = {}
    for name, plan, sched in (("default", fsdpfn.plan(model, (world,)), None), ("pick", res.plan, res.schedule)):
        shape = plan.mesh_shape
        mesh = testing.mesh(shape, ("replicate", "shard")) if len(shape) == 2 else testing.mesh(shape)
        plan = plan.bind(mesh)
        rt = Runtime(model, plan, schedule=sched, prefetch=1)
        params = fsdpfn.shard(model, plan)
        opt, _ = _opt(opt_name, ns_dtype)
        sides[name] = dict(rt=rt, params=params, opt=opt, state=opt.init(params), times=[])

    def step(side):
        rt = side["rt"]
        grads, _ = rt.value_and_grad(lambda ps, x, y: F.cross_entropy(rt.apply(ps, x).flatten(0, 1), y.flatten()))(
            side["params"], x, y
        )
        updates, side["state"] = side["opt"].update(grads, side["state"], side["params"])
        side["params"] = optim.apply_updates(side["params"], updates)

    for i in range(args.warmup + 1 + args.steps):
        for side in sides.values():
            comm.barrier()
            t = time.perf_counter()
            step(side)
            t = _max_over_ranks(time.perf_counter() - t)
            if i > args.warmup:
                side["times"].append(t)
    if rank != 0:
        return None
    pick = res.candidate.describe() if res.speedup > 1 else "the default"
    ratios = [p / d for p, d in zip(sides["pick"]["times"], sides["default"]["times"])]
    return dict(
        world=world,
        pick=pick,
        pred_default=res.default.step_time,
        pred_pick=res.result.step_time,
        peak_default=res.default.memory["peak"],
        peak_pick=res.result.memory["peak"],
        default=sides["default"]["times"],
        picked=sides["pick"]["times"],
        ratios=ratios,
        search_s=search_s,
        candidates=len(res.candidates),
        hw=str(hw),
    )


def search_check(args):
    print(
        f"\nSearch on this machine: budget {args.search_budget_mib} MiB per rank, optimizer {args.optimizers[0]}; "
        f"the pick and the default (zero3, prefetch 1) run interleaved, {args.steps} steps each\n"
    )
    print(
        "| W | pick | predicted default / pick | measured default / pick (median) | pick / default, median of pairs [min-max] | predicted peak default / pick |"
    )
    print("|---|---|---|---|---|---|")
    for w in [int(v) for v in args.world_sizes.split(",")]:
        r = launch(_search_rank, w, args)[0]
        md, mp = statistics.median(r["default"]), statistics.median(r["picked"])
        print(
            f"| {w} | {r['pick']} | {r['pred_default'] * 1e3:.0f} / {r['pred_pick'] * 1e3:.0f} ms | {md * 1e3:.0f} / {mp * 1e3:.0f} ms | "
            f"{statistics.median(r['ratios']):.2f} [{min(r['ratios']):.2f}-{max(r['ratios']):.2f}] | "
            f"{r['peak_default'] / 2**20:.0f} / {r['peak_pick'] / 2**20:.0f} MiB |  <!-- {r['candidates']} candidates, {r['search_s']:.0f} s -->"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="2,3,4")
    p.add_argument(
        "--strategies",
        default="local,replicate,zero1,zero2,zero3,hsdp",
        help="local: the unsharded model on each rank, no runtime (a reference for the compute terms)",
    )
    p.add_argument("--prefetch", default="0,1,2")
    p.add_argument("--optimizers", default="adamw,muon")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ns-dtype", default="float32")
    p.add_argument("--probe-repeats", type=int, default=3, help="repeats of each hardware timing per round")
    p.add_argument(
        "--stat",
        choices=("min", "median"),
        default="median",
        help="statistic of the measured steps and of the hardware timings: min (default; the least disturbed "
        "sample on a shared machine) or median",
    )
    p.add_argument(
        "--search-check",
        action="store_true",
        help="instead of the grid: search a plan for this machine per world size and run it against the default",
    )
    p.add_argument("--search-budget-mib", type=float, default=128.0)
    p.add_argument(
        "--timed-compute",
        action="store_true",
        help="add a column predicted with each stretch's compute timed on the ranks (profile(timed=True))",
    )
    p.add_argument("--explain", action="store_true", help="print each row's predicted step (summary) too")
    args = p.parse_args(argv)
    args.strategies = args.strategies.split(",")
    args.prefetch = [int(v) for v in args.prefetch.split(",")]
    args.optimizers = args.optimizers.split(",")
    print("$ OMP_NUM_THREADS=1 python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])))
    print(
        f"GPT width {args.width}, {args.depth} blocks, vocabulary {args.vocab}, sequence {args.seq}, batch {args.batch}/rank; "
        f"{args.steps} measured steps per row after {args.warmup + 1} warm-up, interleaved; Newton-Schulz in {args.ns_dtype}"
    )
    _STAT[0] = args.stat
    _TIMED[0] = args.timed_compute
    if args.search_check:
        search_check(args)
        return
    all_rows = []
    for w in [int(v) for v in args.world_sizes.split(",")]:
        t0 = time.time()
        rows, hw = launch(_rank, w, args)[0]
        print(f"\nW={w} ({time.time() - t0:.0f} s) hardware fitted on timings taken between the rounds:\n{hw}")
        if len(args.world_sizes.split(",")) > 1:  # kept if a later world size fails (e.g. out of memory)
            _table(rows)
        sys.stdout.flush()
        all_rows += rows
    _table(all_rows)


_STAT = ["median"]
_TIMED = [False]


def _table(rows):
    mib = 2**20
    timed = _TIMED[0]
    print(
        f"\n| W | strategy | mesh | prefetch | optimizer | predicted | measured {_STAT[0]} [min-max] | time error | "
        + ("error, compute timed | " if timed else "")
        + "optimizer step predicted / measured | high-water predicted / measured | memory error | bytes |"
    )
    print("|---" * (12 + timed) + "|")
    errs, merrs = [], []
    stat = statistics.median if _STAT[0] == "median" else min
    errs_m = []
    for r in rows:
        med = stat(r["times"])
        err = (r["pred"] - med) / med
        err_m = (r["pred_m"] - med) / med
        errs.append(abs(err))
        errs_m.append(abs(err_m))
        if r["hw"] is None:
            mem = "n/a | n/a"
        else:
            merr = (r["pred_hw"] - r["hw"]) / r["hw"] if r["hw"] else 0.0
            merrs.append(abs(merr))
            mem = f"{r['pred_hw'] / mib:.2f} / {r['hw'] / mib:.2f} MiB | {merr * 100:+.1f}%"
        mesh = "x".join(map(str, r["mesh"]))
        prefetch = "-" if r["name"] == "local" else r["prefetch"]
        print(
            f"| {r['world']} | {r['name']} | {mesh} | {prefetch} | {r['opt']} | {r['pred'] * 1e3:.0f} ms | "
            f"{med * 1e3:.0f} ms [{min(r['times']) * 1e3:.0f}-{max(r['times']) * 1e3:.0f}] | {err * 100:+.1f}% | "
            + (f"{err_m * 100:+.1f}% | " if timed else "")
            + f"{r['pred_opt'] * 1e3:.0f} / {stat(r['opt_times']) * 1e3:.0f} ms | "
            f"{mem} | {'equal' if r['bytes_ok'] else 'DIFFER'} |"
        )
    for r in rows:
        if r.get("summary"):
            print(
                f"\n--- W={r['world']} {r['name']} prefetch {r['prefetch']} {r['opt']}: measured {stat(r['times']) * 1e3:.0f} ms\n{r['summary']}"
            )
    within = sum(e <= 0.15 for e in errs)
    print(
        f"\ntime: {within}/{len(errs)} rows within 15%; median |error| {statistics.median(errs) * 100:.1f}%, max {max(errs) * 100:.1f}%"
    )
    if timed:
        print(
            f"time, compute timed by profile(timed=True): {sum(e <= 0.15 for e in errs_m)}/{len(errs_m)} rows within 15%; "
            f"median |error| {statistics.median(errs_m) * 100:.1f}%, max {max(errs_m) * 100:.1f}%"
        )
    print(f"memory: {sum(e <= 0.05 for e in merrs)}/{len(merrs)} rows within 5%; max |error| {max(merrs) * 100:.1f}%")
    bad = [r for r in rows if not r["bytes_ok"]]
    for r in bad[:5]:
        print(
            f"bytes differ W={r['world']} {r['name']} p{r['prefetch']} {r['opt']}: counted {r['counted']} predicted {r['predicted']}"
        )


if __name__ == "__main__":
    main()
