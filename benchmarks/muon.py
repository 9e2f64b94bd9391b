"""Muon's distributed Newton–Schulz on a GPT-style model, measured on gloo ranks.

Prints, per the rules of docs/benchmarks.md (both sides in one launch, interleaved, median of the
pairwise ratios, min-max spread; counts beside times):

1. Newton–Schulz FLOPs summed over ranks / one-process FLOPs, for the "owner" and "gather"
   layouts (FlopCounterMode around ``opt.update`` on every rank; goal 1.0 for owner, W for gather).
2. Muon's extra collective bytes per rank per step (fsdpfn.count_collectives) against the theory
   ``2 (W-1)/W^2 * Psi_M`` (owner) and ``(W-1)/W * Psi_M`` (gather), with Psi_M the Muon matrices'
   bytes in the Newton–Schulz dtype (bf16: that is what is sent).
3. Optimizer step time, owner vs gather.
4. The whole zero3 training step with ``muon`` / the same with ``adamw`` (goal <= 1.15x), for
   the standard Newton–Schulz iteration and for ``ns_method="gram"`` (the same polynomial on the
   Gram matrix, fewer FLOPs on wide matrices), interleaved in one launch.

``--vs-torch`` instead prints the optimizer step alone, fsdpfn ``muon`` (owner layout, bf16
Newton–Schulz) against ``torch.optim.Muon``'s update (bf16 Newton–Schulz, hard-coded) on torch
FSDP2 (``fully_shard``, zero3) parameters, the two ways a user can run it: the optimizer
directly on the DTensor parameters (``_TorchMuonDTensor``), or torch's Newton–Schulz on
``full_tensor()`` matrices, local rows kept (``_TorchMuonFull``). AdamW (torch's on the torch
sides) takes the parameters ``muon_labels`` does not give to Muon. All sides start from the same
parameters and get the same gradients (fsdpfn's, copied into ``p.grad``; FSDP2 and fsdpfn shard
rows alike), so the first update is compared too. FLOPs are counted twice: FlopCounterMode, and
the profiler's innermost matmul kernels (the local work, whatever DTensor does above it).

``--project`` prints, without ranks, the layouts' bytes and FLOPs for Llama-3-8B-like matrices at
tp = 8 from the optimizer's own schedule, then ``fsdpfn.sim.Muon``'s whole optimizer step for the
same model on the H100 preset (owner, duplicated, blockwise), beside Megatron-LM's published
layer-sharded Muon figures, with the ratios.

``--tokens-sweep`` instead prints the whole-step muon/adamw ratio (owner, fp32 Newton–Schulz by
default) at several batch sizes per rank, beside the FLOP-only prediction.

Usage:
  python benchmarks/muon.py                       # width 512, 4 blocks, vocab 4096, seq 256, batch 4/rank
  python benchmarks/muon.py --width 128 --steps 5 # a quick look
  python benchmarks/muon.py --ns-dtype float32    # fp32 Newton-Schulz (CPUs without native bf16 matmul)
  python benchmarks/muon.py --vs-torch --width 256 --vocab 2048 --seq 128 --steps 12
  python benchmarks/muon.py --tokens-sweep --ns-dtype float32 --batches 4,8,16 --steps 6 --warmup 1
  python benchmarks/muon.py --project
  python benchmarks/muon.py --tokens-sweep --ns-dtype float32 --ns-method gram --batches 4,8,16 --steps 6 --warmup 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import fsdpfn
from fsdpfn import optim, testing
from fsdpfn._rows import chunk_bounds
from fsdpfn.models import GPT, GPTConfig


def _max_over_ranks(t: float) -> float:
    buf = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return buf.item()


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return out, _max_over_ranks(time.perf_counter() - t0)


def _grad_fn(model, plan, cfg, batch, rank):
    """``torch.func.grad`` of the pure loop's loss on this rank's fixed batch."""
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(ps):
        logits = torch.func.functional_call(model, fsdpfn.unshard(ps, plan), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return torch.func.grad(loss_fn)


def _bench(rank, world, cfg_kw, batch, steps, warmup, ns_dtype):
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params0 = fsdpfn.shard(model, plan)
    grad_fn = _grad_fn(model, plan, cfg, batch, rank)
    with FlopCounterMode(display=False) as f:
        grads = grad_fn(params0)
    train_flops = f.get_total_flops()
    ns_dtype = getattr(torch, ns_dtype)
    opts = {
        "owner": optim.muon(lr=0.02, layout="owner", ns_dtype=ns_dtype),
        "gather": optim.muon(lr=0.02, layout="gather", ns_dtype=ns_dtype),
        "owner gram": optim.muon(lr=0.02, layout="owner", ns_dtype=ns_dtype, ns_method="gram"),
        "adamw": optim.adamw(3e-4, weight_decay=0.1),
    }
    states = {k: o.init(params0) for k, o in opts.items()}

    # 1-2: count FLOPs and bytes of one update per layout.
    counts = {}
    for k in ("owner", "gather", "owner gram"):
        with fsdpfn.count_collectives() as c, FlopCounterMode(display=False) as f:
            opts[k].update(grads, states[k], params0)
        counts[k] = dict(flops=f.get_total_flops(), wire=sum(c.wire_bytes().values()), calls=c.counts())
    muon_names = [n for n, p in params0.items() if optim.muon_labels(n, p) == "muon"]
    one_process_flops = {
        m: sum(optim.newton_schulz_flops(tuple(params0[n].shape), method=m) for n in muon_names)
        for m in ("standard", "gram")
    }
    psi_m = sum(params0[n].numel() * ns_dtype.itemsize for n in muon_names)  # bytes as sent

    # 3: optimizer step, owner vs gather vs owner with Gram Newton–Schulz, interleaved.
    opt_times = {"owner": [], "gather": [], "owner gram": []}
    for i in range(warmup + steps):
        for k in opt_times:
            _, t = _timed(lambda: opts[k].update(grads, states[k], params0))
            if i >= warmup:
                opt_times[k].append(t)

    # 4: whole training step, muon (owner; standard and Gram) vs adamw, interleaved, each on its
    # own trajectory.
    sides = (("muon", "owner"), ("muon gram", "owner gram"), ("adamw", "adamw"))
    run = {k: [params0, opts[o], states[o]] for k, o in sides}
    step_times = {k: [] for k in run}

    def train_step(k):
        params, opt, state = run[k]
        g = grad_fn(params)
        updates, state = opt.update(g, state, params)
        run[k][0], run[k][2] = optim.apply_updates(params, updates), state

    for i in range(warmup + steps):
        for k in step_times:
            _, t = _timed(lambda: train_step(k))
            if i >= warmup:
                step_times[k].append(t)
    return dict(
        train_flops=train_flops,
        counts=counts,
        one_process_flops=one_process_flops,
        psi_m=psi_m,
        opt_times=opt_times,
        step_times=step_times,
        n_muon=len(muon_names),
    )


# ---------------------------------------------------------------------------------------------
# --vs-torch: the optimizer step alone, fsdpfn muon vs torch.optim.Muon on FSDP2 parameters
# ---------------------------------------------------------------------------------------------

_HP = dict(lr=0.02, momentum=0.95, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)  # fsdpfn muon's defaults, lr 0.02


def _fsdp2_model(cfg, mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    named = dict(model.named_parameters())
    muon_names = [n for n, p in named.items() if optim.muon_labels(n, p) == "muon"]
    rest = [p for n, p in named.items() if n not in muon_names]
    adamw = torch.optim.AdamW(rest, lr=_HP["lr"], betas=_HP["betas"], eps=_HP["eps"], weight_decay=_HP["weight_decay"])
    return model, named, muon_names, adamw


class _TorchMuonDTensor:
    """``torch.optim.Muon`` as a user writes it on FSDP2: the hidden 2-D DTensor parameters go
    straight in (``p.ndim == 2`` holds for DTensors), AdamW takes the rest. Its Newton–Schulz then
    runs as DTensor ops on ``Shard(0)`` matrices and is correct (DTensor redistributes as each op
    needs): square and wide matrices all-gather an operand per matmul and compute their local
    rows; tall ones are transposed first (``Shard(1)``), so the Gram matrix is a partial sum
    (all-reduce) and some products run replicated. Net: more than one-process FLOPs summed over
    ranks, fewer than W times, and a few hundred small collectives per step."""

    name = "torch.optim.Muon on DTensors"

    def __init__(self, cfg, mesh):
        self.model, self.named, muon_names, self.adamw = _fsdp2_model(cfg, mesh)
        self.muon = torch.optim.Muon(
            [self.named[n] for n in muon_names],
            lr=_HP["lr"],
            weight_decay=_HP["weight_decay"],
            momentum=_HP["momentum"],
            nesterov=True,
        )

    def step(self):
        self.muon.step()
        self.adamw.step()


class _TorchMuonFull:
    """``torch.optim.Muon``'s update with the matrices made whole first, as a user who does not
    trust DTensor's implicit redistribution does it: momentum on the local shard (elementwise,
    ``torch.optim._muon._single_tensor_muon``'s lines), ``full_tensor()`` of the direction (one
    all-gather per matrix), ``torch.optim._muon._zeropower_via_newtonschulz`` (bf16) on the full
    matrix on every rank, keep the local rows, then torch's lr adjustment and weight decay."""

    name = "torch NS on full_tensor()"

    def __init__(self, cfg, mesh):
        self.model, self.named, self.muon_names, self.adamw = _fsdp2_model(cfg, mesh)
        self.bufs = {n: torch.zeros_like(self.named[n].to_local()) for n in self.muon_names}

    @torch.no_grad()
    def step(self):
        from torch.distributed.tensor import DTensor
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _adjust_lr, _zeropower_via_newtonschulz

        lr, wd, mom = _HP["lr"], _HP["weight_decay"], _HP["momentum"]
        for n in self.muon_names:
            p = self.named[n]
            g, buf = p.grad.to_local(), self.bufs[n]
            buf.lerp_(g, 1 - mom)
            d = g.lerp(buf, mom)  # nesterov
            full = DTensor.from_local(d, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            o = _zeropower_via_newtonschulz(full, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7)
            start, stop = _chunk(p.shape[0], dist.get_world_size(), dist.get_rank())
            local = p.to_local()
            local.mul_(1 - lr * wd)
            local.add_(o[start:stop], alpha=-_adjust_lr(lr, None, p.shape))
        self.adamw.step()


_MM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _local_mm_flops(fn) -> int:
    """Matmul FLOPs of the plain-tensor (local) kernels ``fn`` runs: the profiler's FLOPs of the
    innermost ``mm``/``addmm``/``bmm``/``baddbmm`` events. FlopCounterMode cannot give this on
    DTensors: it sees the DTensor op (global shapes), not the local kernels under it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        fn()

    def inner(e):
        return not any(c.name in _MM or not inner(c) for c in e.cpu_children)

    return int(sum(e.flops or 0 for e in prof.events() if e.name in _MM and inner(e)))


_chunk = chunk_bounds  # the plan's torch.chunk split


def _vs_torch(rank, world, cfg_kw, steps, warmup):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    cfg = GPTConfig(**cfg_kw)
    mesh = testing.mesh((world,))
    torch.manual_seed(0)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, mesh, strategy="zero3")
    params = fsdpfn.shard(model, plan)
    grads = _grad_fn(model, plan, cfg, 4, rank)(params)
    opt = optim.muon(
        lr=_HP["lr"],
        momentum=_HP["momentum"],
        weight_decay=_HP["weight_decay"],
        ns_dtype=torch.bfloat16,
        layout="owner",
    )
    fs = {"params": params, "state": opt.init(params)}

    def fsdpfn_step():
        updates, fs["state"] = opt.update(grads, fs["state"], fs["params"])
        fs["params"] = optim.apply_updates(fs["params"], updates)

    sides = [_TorchMuonDTensor(cfg, mesh), _TorchMuonFull(cfg, mesh)]
    for side in sides:  # the same gradients as fsdpfn's (FSDP2 shards rows like torch.chunk, as fsdpfn does)
        for n, p in side.named.items():
            assert p.to_local().shape == params[n].to_local().shape and torch.equal(
                p.to_local(), params[n].to_local()
            ), n
            p.grad = DTensor.from_local(
                grads[n].to_local().clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )

    # First step, counted: FLOPs (FlopCounterMode), collectives, and the update vs fsdpfn's.
    before = {n: p.to_local().clone() for n, p in params.items()}
    with FlopCounterMode(display=False) as f, fsdpfn.count_collectives() as c:
        local = _local_mm_flops(fsdpfn_step)
    counts = {"fsdpfn": dict(flops=f.get_total_flops(), local=local, calls=c.counts())}
    ref = {n: fs["params"][n].to_local() - before[n] for n in params}
    for side in sides:
        with FlopCounterMode(display=False) as f, CommDebugMode() as cm:
            local = _local_mm_flops(side.step)
        diff = max((side.named[n].to_local() - before[n] - ref[n]).abs().max().item() for n in params)
        scale = max(ref[n].abs().max().item() for n in params)
        calls = {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}
        counts[side.name] = dict(flops=f.get_total_flops(), local=local, calls=calls, rel_diff=diff / scale)

    times = {"fsdpfn": [], **{s.name: [] for s in sides}}
    for i in range(warmup + steps):
        for k, fn in (("fsdpfn", fsdpfn_step), *((s.name, s.step) for s in sides)):
            _, t = _timed(fn)
            if i >= warmup:
                times[k].append(t)
    muon_names = [n for n, p in params.items() if optim.muon_labels(n, p) == "muon"]
    one = sum(optim.newton_schulz_flops(tuple(params[n].shape)) for n in muon_names)
    return dict(counts=counts, times=times, one=one, n_muon=len(muon_names))


def _print_vs_torch(res, args, cfg_kw):
    w, r0 = args.world, res[0]
    one = r0["one"]
    print(
        f"model: GPTConfig({cfg_kw}), {w} gloo ranks, zero3 (FSDP2 fully_shard per block + root), 1 thread/rank, torch {torch.__version__}"
    )
    print(
        "optimizer step alone (no forward/backward), same gradients on all sides; lr 0.02, momentum 0.95 nesterov, wd 0.1, AdamW (0.9, 0.999) eps 1e-8 for non-Muon params"
    )
    print(
        f"Muon matrices: {r0['n_muon']}, one-process Newton-Schulz FLOPs = {one / 1e9:.2f} GFLOP/step (5 steps, bf16 on every side)\n"
    )
    print(
        "| side | NS FLOPs/rank, max rank (FlopCounterMode) | summed over ranks / one process | local matmul FLOPs/rank, max rank (profiler) | summed / one process | collectives/rank/step | update vs fsdpfn (max abs diff / max abs update) |"
    )
    print("|---|---|---|---|---|---|---|")
    for k in r0["counts"]:
        flops = [r["counts"][k]["flops"] for r in res]
        local = [r["counts"][k]["local"] for r in res]
        rel = "-" if k == "fsdpfn" else f"{max(r['counts'][k]['rel_diff'] for r in res):.1e}"
        print(
            f"| {k} | {max(flops) / 1e9:.2f} GFLOP | {sum(flops) / one:.2f} | {max(local) / 1e9:.2f} GFLOP | {sum(local) / one:.2f} | "
            f"{r0['counts'][k]['calls']} | {rel} |"
        )
    print(
        f"\n| optimizer step ({args.steps} interleaved rounds, max over ranks) | A median | B median | A/B median of pairs | A/B min-max |"
    )
    print("|---|---|---|---|---|")
    for k in list(r0["times"])[1:]:
        print(_ratio_line(f"fsdpfn muon owner bf16 (A) vs {k} (B)", r0["times"]["fsdpfn"], r0["times"][k]))


# ---------------------------------------------------------------------------------------------
# --tokens-sweep: whole-step muon/adamw ratio against tokens per rank
# ---------------------------------------------------------------------------------------------


def _sweep(rank, world, cfg_kw, batches, steps, warmup, ns_dtype, ns_method):
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = GPT(cfg)
    plan = fsdpfn.plan(model, testing.mesh((world,)), strategy="zero3")
    params0 = fsdpfn.shard(model, plan)
    muon = optim.muon(lr=0.02, layout="owner", ns_dtype=getattr(torch, ns_dtype), ns_method=ns_method)
    opts = {"muon": muon, "adamw": optim.adamw(3e-4, weight_decay=0.1)}
    rows = []
    for batch in batches:
        grad_fn = _grad_fn(model, plan, cfg, batch, rank)
        with FlopCounterMode(display=False) as f:
            g = grad_fn(params0)
        train = f.get_total_flops()
        state = opts["muon"].init(params0)
        with FlopCounterMode(display=False) as f:
            opts["muon"].update(g, state, params0)
        ns = f.get_total_flops()
        run = {k: [params0, o, o.init(params0)] for k, o in opts.items()}
        times = {"muon": [], "adamw": []}

        def train_step(k):
            params, opt, st = run[k]
            updates, st = opt.update(grad_fn(params), st, params)
            run[k][0], run[k][2] = optim.apply_updates(params, updates), st

        for i in range(warmup + steps):
            for k in ("muon", "adamw"):
                _, t = _timed(lambda: train_step(k))
                if i >= warmup:
                    times[k].append(t)
        rows.append(dict(batch=batch, train=_max_over_ranks(train), ns=_max_over_ranks(ns), times=times))
    return rows


def _print_sweep(res, args, cfg_kw):
    print(
        f"model: GPTConfig({cfg_kw}), {args.world} gloo ranks, zero3, muon owner layout, {args.ns_method} {args.ns_dtype} Newton-Schulz, "
        f"1 thread/rank, torch {torch.__version__}"
    )
    print(
        f"{args.steps} interleaved measured pairs per row after {args.warmup} warm-up; times are max over ranks; FLOPs: busiest rank\n"
    )
    print(
        "| batch/rank | tokens/rank | fwd+bwd GFLOP | NS GFLOP | adamw step | muon step | muon/adamw median of pairs | min-max | FLOP-only prediction (train+NS)/train |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in res[0]:
        m, a = row["times"]["muon"], row["times"]["adamw"]
        ratios = [p / q for p, q in zip(m, a)]
        print(
            f"| {row['batch']} | {row['batch'] * args.seq} | {row['train'] / 1e9:.1f} | {row['ns'] / 1e9:.2f} | {statistics.median(a):.2f} s | "
            f"{statistics.median(m):.2f} s | {statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x | {(row['train'] + row['ns']) / row['train']:.2f}x |"
        )
    last = res[0][-1]
    per_token = last["train"] / (last["batch"] * args.seq)
    need = last["ns"] / 0.15 / per_token
    print(
        f"\nFLOP-only: 1.15x needs fwd+bwd >= NS/0.15, i.e. about {need:.0f} tokens/rank (batch {need / args.seq:.1f} at seq {args.seq}; linear extrapolation from the last row)"
    )


# ---------------------------------------------------------------------------------------------
# --pipeline: the owner layout's buckets, communication under Newton–Schulz
# ---------------------------------------------------------------------------------------------


def _pipeline(rank, world, cfg_kw, steps, warmup, ns_dtype, heads, experts, buckets):
    """The Muon matrices' Newton–Schulz alone (``optim.orthogonalize``, owner layout), on random
    momentum-like rows: pipelined (``buckets``) vs one bucket, interleaved with the same step's
    compute alone (this rank's batches, no collective) and its communication alone (the same
    all-to-alls, same splits, same order, nothing computed)."""
    import fnmatch

    from fsdpfn import comm
    from fsdpfn.optim._owner import _Bucket
    from fsdpfn.transforms import from_local

    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = GPT(cfg)
    mesh = testing.mesh((world,))
    plan = fsdpfn.plan(model, mesh, strategy="zero3")
    params = fsdpfn.shard(model, plan)
    dtype = getattr(torch, ns_dtype)
    names = [n for n, p in params.items() if optim.muon_labels(n, p) == "muon"]
    table = optim.head_blocks(heads) if heads else {}
    if experts:  # the MLP read as `experts` packed experts: fc's rows, out's columns
        table.update({"*fc.weight": (experts, 1), "*out.weight": (1, experts)})
    specs = [next((s for pat, s in table.items() if fnmatch.fnmatchcase(n, pat)), (1, 1)) for n in names]
    gen = torch.Generator().manual_seed(1 + rank)
    leaves = [from_local(plan, n, torch.randn(params[n].to_local().shape, generator=gen)) for n in names]
    shapes = [tuple(params[n].shape) for n in names]
    flops = lambda shape: optim.newton_schulz_flops(shape)  # noqa: E731
    sched = optim.owner_schedule(shapes, world, flops, specs=specs, buckets=buckets, itemsize=dtype.itemsize)
    n_buckets = len(sched.buckets)
    plans = [_Bucket(sched, k, rank, dtype, torch.device("cpu")) for k in range(n_buckets)]
    group = mesh.get_group(0)

    def step(b):
        optim.orthogonalize(leaves, names, layout="owner", dtype=dtype, blocks=specs, buckets=b)

    # Compute alone: this rank's batches, bucket by bucket, as the owner layout stacks them.
    stacks = []
    for p in plans:
        by_shape = {}
        for b in p.mine:
            by_shape[b.shape] = by_shape.get(b.shape, 0) + 1
        stacks += [torch.randn(count, *shape, generator=gen) for shape, count in by_shape.items()]

    def compute():
        for x in stacks:
            optim.newton_schulz(x, dtype=dtype)

    # Communication alone: both trips of every bucket, blocking, in the pipeline's order.
    bufs = []
    for p in plans:
        trips = []
        for way in ("out", "back"):
            send_splits, recv_splits = p.splits(way)
            trips.append(
                (
                    torch.randn(sum(send_splits)).to(dtype),
                    torch.empty(sum(recv_splits), dtype=dtype),
                    send_splits,
                    recv_splits,
                )
            )
        bufs.append(trips)

    def communicate():
        for way in (0, 1):
            for trips in bufs:
                send, recv, send_splits, recv_splits = trips[way]
                comm.all_to_all(
                    recv, send, group, output_splits=recv_splits, input_splits=send_splits, tag="muon_owner"
                ).wait()

    with fsdpfn.count_collectives() as c1, FlopCounterMode(display=False) as f1:
        step(1)
    with fsdpfn.count_collectives() as cb, FlopCounterMode(display=False) as fb, optim.record_pipeline() as rec:
        step(buckets)
    record = [(b.bucket, b.blocks, b.flops, b.in_flight, b.wait_s, b.compute_s) for b in rec.buckets]
    counted = dict(
        one=dict(calls=c1.counts(), wire=sum(c1.wire_bytes().values()), flops=f1.get_total_flops()),
        pipe=dict(calls=cb.counts(), wire=sum(cb.wire_bytes().values()), flops=fb.get_total_flops()),
    )
    sides = {
        "pipelined": lambda: step(buckets),
        "one bucket": lambda: step(1),
        "compute alone": compute,
        "comm alone": communicate,
    }
    times = {k: [] for k in sides}
    records = []
    for i in range(warmup + steps):
        for k, fn in sides.items():
            if k in ("pipelined", "one bucket"):
                with optim.record_pipeline() as r:
                    _, t = _timed(fn)
                if i >= warmup:
                    records.append(
                        (k, sum(b.wait_s for b in r.buckets) + r.back_wait_s, r.overlapped(), len(r.buckets))
                    )
            else:
                _, t = _timed(fn)
            if i >= warmup:
                times[k].append(t)
    blocks = len(sched.blocks)
    return dict(
        times=times,
        counted=counted,
        record=record,
        records=records,
        n_buckets=n_buckets,
        blocks=blocks,
        n_mats=len(names),
        loads=list(sched.loads),
        psi=sum(math.prod(s) for s in shapes) * dtype.itemsize,
    )


def _print_pipeline(res, args, cfg_kw):
    w, r0 = args.world, res[0]
    print(
        f"model: GPTConfig({cfg_kw}), {w} gloo ranks, zero3, owner layout, {args.ns_dtype} Newton-Schulz, "
        f"blocks: {'per head (' + str(args.heads) + ' heads)' if args.per_head else 'whole attention matrices'}, "
        f"{'MLP as ' + str(args.per_expert) + ' packed experts' if args.per_expert else 'whole MLP matrices'}; 1 thread/rank, torch {torch.__version__}"
    )
    print(
        f"Muon matrices: {r0['n_mats']} ({r0['blocks']} blocks), Psi_M = {r0['psi'] / 2**20:.1f} MiB; buckets: {r0['n_buckets']} "
        f"({'auto' if args.buckets is None else args.buckets}); NS GFLOP per rank: {[round(x / 1e9, 2) for x in r0['loads']]}"
    )
    one, pipe = r0["counted"]["one"], r0["counted"]["pipe"]
    print(
        f"counted, one step: one bucket {one['calls']} {one['wire'] / 2**20:.2f} MiB/rank, pipelined {pipe['calls']} "
        f"{pipe['wire'] / 2**20:.2f} MiB/rank; NS FLOPs summed over ranks pipelined / one bucket = "
        f"{sum(r['counted']['pipe']['flops'] for r in res) / sum(r['counted']['one']['flops'] for r in res):.3f}\n"
    )
    print(
        "| bucket (rank 0, first counted step) | blocks | NS GFLOP | in flight while it computed | waited before (ms) | computed (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for bucket, blocks, flops, flying, wait, comp in r0["record"]:
        print(
            f"| {bucket} | {blocks} | {flops / 1e9:.2f} | {', '.join(flying) or '-'} | {wait * 1e3:.1f} | {comp * 1e3:.1f} |"
        )
    for side in ("pipelined", "one bucket"):
        over = sum(rec[2] for r in res for rec in r["records"] if rec[0] == side)
        total = sum(rec[3] for r in res for rec in r["records"] if rec[0] == side)
        print(
            f"\n{side}, every rank, every timed step: {over} of {total} buckets computed with a collective in flight",
            end="",
        )
    print()
    t = r0["times"]
    med = {k: statistics.median(v) for k, v in t.items()}
    exposed = {
        side: statistics.median(
            [max(rec[1] for rec in recs) for recs in zip(*[[x for x in r["records"] if x[0] == side] for r in res])]
        )
        for side in ("pipelined", "one bucket")
    }
    print(f"\n| timed ({args.steps} interleaved rounds, max over ranks) | median | min-max |")
    print("|---|---|---|")
    for k, v in t.items():
        print(f"| {k} | {med[k]:.3f} s | {min(v):.3f}-{max(v):.3f} s |")
    sums = [c + m for c, m in zip(t["compute alone"], t["comm alone"])]
    print(f"| compute alone + comm alone | {statistics.median(sums):.3f} s | {min(sums):.3f}-{max(sums):.3f} s |")
    for side in ("pipelined", "one bucket"):
        print(f"| {side}: time blocked in its collectives' waits (busiest rank) | {exposed[side]:.3f} s | |")
    print("\n| ratio (pair by pair) | median | min-max |")
    print("|---|---|---|")
    for name, a, b in (
        ("pipelined / one bucket", t["pipelined"], t["one bucket"]),
        ("pipelined / (compute + comm)", t["pipelined"], sums),
        ("one bucket / (compute + comm)", t["one bucket"], sums),
    ):
        r = [x / y for x, y in zip(a, b)]
        print(f"| {name} | {statistics.median(r):.3f} | {min(r):.3f}-{max(r):.3f} |")


# ---------------------------------------------------------------------------------------------
# --mesh DxT: the layouts on a (dp, tp) mesh, and --project: the same arithmetic at scale
# ---------------------------------------------------------------------------------------------

MESH_LAYOUTS = ("owner", "duplicated", "blockwise")


def _tp_boxes(shape, tp_dim, dp, tp):
    """Each rank's box of a matrix on a (dp, tp) mesh (rank = s * tp + t), as fsdpfn.shard lays
    it out: the tp slice along ``tp_dim``, then dp rows of it with torch.chunk."""
    from fsdpfn.optim._layout import Box

    rows, cols = shape
    out = []
    for s in range(dp):
        for t in range(tp):
            r, c = (0, rows), (0, cols)
            if tp_dim == 0:
                r = (t * rows // tp, (t + 1) * rows // tp)
            elif tp_dim == 1:
                c = (t * cols // tp, (t + 1) * cols // tp)
            a, b = chunk_bounds(r[1] - r[0], dp, s)
            out.append(Box((0, 1), (r[0] + a, r[0] + b), c))
    return tuple(out)


def layout_costs(shapes, tp_dims, dp, tp, itemsize, flops=optim.newton_schulz_flops):
    """Per layout: bytes each rank receives from other ranks per step (list over ranks), the
    collectives, and the Newton–Schulz FLOPs each rank runs, from the schedules the optimizer
    runs (``owner_schedule`` on the same boxes): exact, no ranks needed."""
    w = dp * tp
    held = [_tp_boxes(s, d, dp, tp) for s, d in zip(shapes, tp_dims)]
    out = {}
    for layout in MESH_LAYOUTS:
        specs = [(1, 1)] * len(shapes)
        if layout == "blockwise":
            specs = [(tp, 1) if d == 0 else (1, tp) if d == 1 else (1, 1) for d in tp_dims]
        if layout == "duplicated":
            pad = sum(max(b.numel for b in h) for h in held)
            got = [(w - 1) * pad * itemsize] * w
            ns = [sum(flops(s) for s in shapes)] * w
            out[layout] = dict(received=got, calls=1 if w > 1 else 0, kind="all_gather", flops=ns)
            continue
        sched = optim.owner_schedule(shapes, w, flops, specs=specs, buckets=1, itemsize=itemsize, held=held)
        got = [0] * w
        for j in range(len(sched.blocks)):
            o = sched.owners[j]
            if j in sched.kept:
                continue
            got[o] += sum(b.numel for src, b in sched.pieces[j] if src != o) * itemsize
            for dst, b in sched.returns[j]:
                if dst != o:
                    got[dst] += b.numel * itemsize
        out[layout] = dict(received=got, calls=2 * len(sched.buckets), kind="all_to_all", flops=list(sched.loads))
    return out


def _mesh_bench(rank, world, dp, tp, cfg_kw, steps, warmup, ns_dtype):
    from fsdpfn.models import GPT_TP_PLAN

    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kw)
    model = GPT(cfg)
    mesh = testing.mesh((dp, tp), ("dp", "tp"))
    plan = fsdpfn.plan(model, mesh, strategy="zero3", tp=GPT_TP_PLAN)
    params = fsdpfn.shard(model, plan)
    gen = torch.Generator().manual_seed(7)  # the same full gradients on every rank
    full = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    grads = fsdpfn.shard(full, plan, check=False)
    dtype = getattr(torch, ns_dtype)
    names = [n for n, p in params.items() if optim.muon_labels(n, p) == "muon"]
    opts = {k: optim.muon(0.02, ns_dtype=dtype, layout=k) for k in MESH_LAYOUTS}
    states = {k: o.init(params) for k, o in opts.items()}
    counted = {}
    for k, o in opts.items():
        with fsdpfn.count_collectives() as c, FlopCounterMode(display=False) as f:
            up, _ = o.update(grads, states[k], params)
        counted[k] = dict(calls=c.counts(), flops=f.get_total_flops(), update=up)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with FlopCounterMode(display=False) as f:
        ref, _ = opts["owner"].update(full, opts["owner"].init(weights), weights)
    one = f.get_total_flops()
    for k in MESH_LAYOUTS:
        up = counted[k].pop("update")
        counted[k]["bitwise"] = (
            all(torch.equal(up[n].full_tensor(), ref[n]) for n in names) if k != "blockwise" else "n/a (per piece)"
        )
    times = {k: [] for k in MESH_LAYOUTS}
    for i in range(warmup + steps):
        for k, o in opts.items():
            _, t = _timed(lambda: o.update(grads, states[k], params))
            if i >= warmup:
                times[k].append(t)
    shapes = [tuple(params[n].shape) for n in names]
    tp_dims = [plan.param(n).tp_dim for n in names]
    # The boxes the optimizer read from the DTensors, to check layout_costs' own derivation.
    from fsdpfn.optim._layout import holdings, work_group

    wg = work_group(mesh, (0, 1))
    boxes = [holdings(grads[n], n, wg.coords) for n in names]
    return dict(counted=counted, one=one, times=times, shapes=shapes, tp_dims=tp_dims, boxes=boxes)


def _mib(x):
    return f"{x / 2**20:.2f} MiB"


def _print_costs(costs, psi, w, dp, tp, one_flops):
    theory = {
        "owner": 2 * (w - 1) / w**2 * psi,
        "duplicated": (w - 1) / w * psi,
        "blockwise": 2 * (dp - 1) / dp**2 * psi / tp,
    }
    formula = {"owner": "2(W-1)/W² Ψ_M", "duplicated": "(W-1)/W Ψ_M", "blockwise": "2(D-1)/D² Ψ_M/T"}
    print(
        "| layout | received bytes per rank per step: mean [max] | theory | collectives | NS FLOPs summed / one process | busiest rank / mean |"
    )
    print("|---|---|---|---|---|---|")
    for k in MESH_LAYOUTS:
        c = costs[k]
        mean = statistics.mean(c["received"])
        fl = c["flops"]
        print(
            f"| {k} | {_mib(mean)} [{_mib(max(c['received']))}] | {_mib(theory[k])} = {formula[k]} | {c['calls']} {c['kind']} | "
            f"{sum(fl) / one_flops:.3f} | {max(fl) / statistics.mean(fl):.3f} |"
        )
    dup = statistics.mean(costs["duplicated"]["received"])
    print(
        f"owner / duplicated bytes: {statistics.mean(costs['owner']['received']) / dup:.3f}x (formula 2/W = {2 / w:.3f})"
    )


def _run_mesh(args, cfg_kw):
    dp, tp = (int(v) for v in args.mesh.lower().split("x"))
    w = dp * tp
    res = testing.run_on_ranks(_mesh_bench, w, dp, tp, cfg_kw, args.steps, args.warmup, args.ns_dtype, timeout=7200)
    r0 = res[0]
    item = getattr(torch, args.ns_dtype).itemsize
    psi = sum(math.prod(s) for s in r0["shapes"]) * item
    print(
        f"model: GPTConfig({cfg_kw}), mesh dp={dp} x tp={tp} ({w} gloo ranks), GPT tp plan, zero3, {args.ns_dtype} Newton-Schulz, "
        f"1 thread/rank, torch {torch.__version__}"
    )
    print(f"Muon matrices: {len(r0['shapes'])}, Psi_M = {_mib(psi)} ({args.ns_dtype}, as sent)\n")
    print("Counted on the ranks (fsdpfn.count_collectives, FlopCounterMode around opt.update):\n")
    print(
        "| layout | update == one process, bitwise | collectives per rank per step | NS FLOPs summed over ranks / one process |"
    )
    print("|---|---|---|---|")
    for k in MESH_LAYOUTS:
        c = r0["counted"][k]
        total = sum(r["counted"][k]["flops"] for r in res)
        print(f"| {k} | {c['bitwise']} | {c['calls']} | {total / r0['one']:.3f} |")
    assert [list(b) for b in r0["boxes"]] == [
        list(_tp_boxes(s, d, dp, tp)) for s, d in zip(r0["shapes"], r0["tp_dims"])
    ]
    costs = layout_costs(r0["shapes"], r0["tp_dims"], dp, tp, item)
    one_ns = sum(optim.newton_schulz_flops(s) for s in r0["shapes"])
    print(
        "\nFrom the schedules the ranks ran (the same owner_schedule on the same boxes; bytes each rank receives from the others):\n"
    )
    _print_costs(costs, psi, w, dp, tp, one_ns)
    print(
        f"\n| timed ({args.steps} interleaved rounds, max over ranks) | A median | B median | A/B median of pairs | A/B min-max |"
    )
    print("|---|---|---|---|---|")
    t = r0["times"]
    print(_ratio_line("optimizer step: owner (A) vs duplicated (B)", t["owner"], t["duplicated"]))
    print(_ratio_line("optimizer step: blockwise (A) vs owner (B)", t["blockwise"], t["owner"]))


def _project(args):
    """Llama-3-8B-like matrices (hidden 4096, MLP 14336, 8 KV heads of 128, 32 layers), colwise
    q/k/v/gate/up and rowwise o/down, at tp = 8: the layouts' bytes and FLOPs per rank."""
    h, f, kv = 4096, 14336, 1024
    layer = [((h, h), 0), ((kv, h), 0), ((kv, h), 0), ((h, h), 1), ((f, h), 0), ((f, h), 0), ((h, f), 1)]
    shapes = [s for s, _ in layer] * 32
    tp_dims = [d for _, d in layer] * 32
    item = 2
    psi = sum(math.prod(s) for s in shapes) * item
    one = sum(optim.newton_schulz_flops(s) for s in shapes)
    print(
        f"Llama-3-8B-like Muon matrices: {len(shapes)}, Psi_M = {psi / 2**30:.2f} GiB in bf16, one-process NS {one / 1e12:.1f} TFLOP/step\n"
    )
    for dp, tp in ((1, 8), (2, 8)):
        print(f"dp={dp} x tp={tp}:\n")
        _print_costs(layout_costs(shapes, tp_dims, dp, tp, item), psi, dp * tp, dp, tp, one)
        print()
    _sim_projection()


LLAMA_TP_PLAN = {
    "layers.*.attn.wq": "colwise",
    "layers.*.attn.wk": "colwise",
    "layers.*.attn.wv": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.mlp.w1": "colwise",
    "layers.*.mlp.w3": "colwise",
    "layers.*.mlp.w2": "rowwise",
}
# NVIDIA/Megatron-LM issue #6676 (layer-sharded Muon; implementation in pull request #6683): 32 GB300 GPUs,
# TP2 x gtp_remat8 dense domain, EP8 x egtp2 experts, "production matrix shapes" (not published).
PUBLISHED = dict(
    step_duplicated=0.632, step_layer_sharded=0.157, step_distributed=0.356, calls_duplicated=276, calls_layer_sharded=4
)


def _sim_projection():
    """The simulator's cost of the whole ``muon`` optimizer step (fsdpfn.sim.Muon: the optimizer's
    own boxes, owner schedule and all-to-all splits, timed on the H100 preset) for Llama-3-8B
    shapes, per layout, beside Megatron's published layer-sharded Muon figures."""
    from fsdpfn import sim
    from fsdpfn.models import Llama, LlamaConfig

    cfg = LlamaConfig(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    with torch.device("meta"):
        model = Llama(cfg)
    meshes = {
        "dp 1 x tp 8 (8 GPUs, one node)": {"dp": 1, "tp": 8},
        "replicate 2 x shard 8 x tp 2 (32 GPUs: the published run's TP2 x 8-way weight-shard domain)": {
            "replicate": 2,
            "shard": 8,
            "tp": 2,
        },
    }
    empty = sim.Workload(())  # the optimizer step alone
    print(
        "\nThe simulator's projection (fsdpfn.sim.Muon on the plan, H100 preset, bf16 Newton-Schulz, whole optimizer step "
        "incl. momentum/AdamW elementwise work; calls and bytes per rank as fsdpfn.count_collectives would record them):\n"
    )
    rows = {}
    for label, mesh in meshes.items():
        plan = fsdpfn.plan(model, mesh, tp=LLAMA_TP_PLAN)
        print(f"{label}:\n")
        print(
            "| layout | optimizer step | collectives per rank | bytes per rank (as recorded) | NS TFLOP, busiest rank |"
        )
        print("|---|---|---|---|---|")
        for layout, buckets in (("owner", None), ("owner", 1), ("duplicated", None), ("blockwise", None)):
            opt = sim.Muon(layout=layout, ns_dtype=torch.bfloat16, buckets=buckets)
            r = sim.simulate(plan, None, empty, opt, sim.H100_SXM)
            t = r.traffic["optimizer"]
            calls = sum(x.calls for x in t.values())
            nbytes = sum(x.nbytes for x in t.values())
            kinds = ", ".join(f"{x.calls} {k.replace('_', '-')}" for k, x in t.items()) or "none"
            ns = max(opt.cost(plan).ns_flops)
            name = layout + (", 1 bucket" if buckets == 1 else "")
            rows[(label, name)] = (r.optimizer_time, calls)
            print(
                f"| {name} | {r.optimizer_time * 1e3:,.1f} ms | {kinds} | {nbytes / 2**30:,.2f} GiB | {ns / 1e12:,.1f} |"
            )
        pub = PUBLISHED["step_layer_sharded"] / PUBLISHED["step_duplicated"]
        dup = rows[(label, "duplicated")]
        for name in ("owner", "owner, 1 bucket"):
            own = rows[(label, name)]
            print(
                f"\n{name} / duplicated step: {own[0] / dup[0]:.3f}x (Megatron layer-sharded / duplicated, published: {pub:.3f}x = "
                f"157 / 632 ms; ours / published ratio {own[0] / dup[0] / pub:.2f}); collectives {own[1]} vs {dup[1]} "
                f"(published: {PUBLISHED['calls_layer_sharded']} vs {PUBLISHED['calls_duplicated']})"
            )
        print()
    return rows


def _ratio_line(name, a, b):
    ratios = [x / y for x, y in zip(a, b)]
    return (
        f"| {name} | {statistics.median(a):.3f} s | {statistics.median(b):.3f} s | "
        f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f}x |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--ns-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="Newton-Schulz dtype (torch.optim.Muon: bfloat16)",
    )
    ap.add_argument(
        "--ns-method", default="standard", choices=["standard", "gram"], help="Newton-Schulz method for --tokens-sweep"
    )
    ap.add_argument(
        "--vs-torch",
        action="store_true",
        help="optimizer step alone: fsdpfn muon (owner, bf16 NS) vs torch.optim.Muon on FSDP2 params",
    )
    ap.add_argument("--tokens-sweep", action="store_true", help="whole-step muon/adamw ratio at each of --batches")
    ap.add_argument("--batches", default="4,8,16", help="batch sizes per rank for --tokens-sweep")
    ap.add_argument(
        "--pipeline",
        action="store_true",
        help="Newton-Schulz alone: pipelined owner layout vs one bucket vs compute and communication apart",
    )
    ap.add_argument("--buckets", type=int, default=None, help="--pipeline: buckets (default: the automatic choice)")
    ap.add_argument(
        "--per-head",
        action="store_true",
        help="--pipeline: per-head blocks on qkv and proj (optim.head_blocks(--heads))",
    )
    ap.add_argument(
        "--per-expert",
        type=int,
        default=0,
        help="--pipeline: read the MLP as N packed experts (fc: N row blocks, out: N column blocks)",
    )
    ap.add_argument(
        "--mesh",
        default=None,
        help="DxT: the owner, duplicated and blockwise layouts on a (dp=D, tp=T) mesh of D*T ranks",
    )
    ap.add_argument(
        "--project",
        action="store_true",
        help="the layouts' bytes and FLOPs for Llama-3-8B-like matrices at tp=8, and the "
        "simulator's optimizer step on the H100 preset beside Megatron's published layer-sharded Muon figures (no ranks)",
    )
    args = ap.parse_args()
    cfg_kw = dict(vocab_size=args.vocab, seq_len=args.seq, width=args.width, depth=args.depth, heads=args.heads)
    w = args.world
    if args.project:
        print(f"command: python {' '.join(sys.argv)}")
        _project(args)
        return
    if args.mesh:
        print(f"command: python {' '.join(sys.argv)}")
        _run_mesh(args, cfg_kw)
        return
    if args.pipeline:
        print(f"command: python {' '.join(sys.argv)}")
        heads = args.heads if args.per_head else 0
        res = testing.run_on_ranks(
            _pipeline,
            w,
            cfg_kw,
            args.steps,
            args.warmup,
            args.ns_dtype,
            heads,
            args.per_expert,
            args.buckets,
            timeout=7200,
        )
        _print_pipeline(res, args, cfg_kw)
        return
    if args.vs_torch or args.tokens_sweep:
        print(f"command: python {' '.join(sys.argv)}")
        if args.vs_torch:
            res = testing.run_on_ranks(_vs_torch, w, cfg_kw, args.steps, args.warmup, timeout=7200)
            _print_vs_torch(res, args, cfg_kw)
        if args.tokens_sweep:
            batches = [int(b) for b in args.batches.split(",")]
            res = testing.run_on_ranks(
                _sweep, w, cfg_kw, batches, args.steps, args.warmup, args.ns_dtype, args.ns_method, timeout=7200
            )
            _print_sweep(res, args, cfg_kw)
        return
    res = testing.run_on_ranks(_bench, w, cfg_kw, args.batch, args.steps, args.warmup, args.ns_dtype, timeout=7200)
    r0 = res[0]
    one, psi = r0["one_process_flops"], r0["psi_m"]
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"model: GPTConfig({cfg_kw}), batch {args.batch}/rank, {w} gloo ranks, zero3, 1 thread/rank, torch {torch.__version__}"
    )
    train = max(r["train_flops"] for r in res)
    print(
        f"Muon matrices: {r0['n_muon']}, Psi_M = {psi / 2**20:.2f} MiB ({args.ns_dtype}, as sent), one-process NS FLOPs = "
        f"{one['standard'] / 1e9:.2f} GFLOP/step standard, {one['gram'] / 1e9:.2f} Gram"
    )
    print(f"forward+backward FLOPs per rank = {train / 1e9:.2f} GFLOP")
    for k in ("owner", "owner gram"):
        busiest = max(r["counts"][k]["flops"] for r in res)
        print(
            f"{k}: NS FLOPs on the busiest rank = {busiest / 1e9:.2f} GFLOP; FLOP-ideal muon/adamw = (train + NS) / train = {(train + busiest) / train:.2f}x"
        )
    print(
        "\n| layout | NS FLOPs summed over ranks / one process (same method) | max rank / mean | bytes/rank/step (mean over ranks) | theory | measured/theory | collectives |"
    )
    print("|---|---|---|---|---|---|---|")
    for k, theory, method in (
        ("owner", 2 * (w - 1) / w**2 * psi, "standard"),
        ("gather", (w - 1) / w * psi, "standard"),
        ("owner gram", 2 * (w - 1) / w**2 * psi, "gram"),
    ):
        flops = [r["counts"][k]["flops"] for r in res]
        wire = statistics.mean(r["counts"][k]["wire"] for r in res)
        print(
            f"| {k} | {sum(flops) / one[method]:.3f} | {max(flops) / statistics.mean(flops):.3f} | {wire / 2**20:.2f} MiB | "
            f"{theory / 2**20:.2f} MiB | {wire / theory:.3f} | {r0['counts'][k]['calls']} |"
        )
    print(
        f"\n| timed ({args.steps} interleaved rounds, max over ranks) | A median | B median | A/B median of pairs | A/B min-max |"
    )
    print("|---|---|---|---|---|")
    ot, st = r0["opt_times"], r0["step_times"]
    print(_ratio_line("optimizer step: owner (A) vs gather (B)", ot["owner"], ot["gather"]))
    print(_ratio_line("optimizer step: owner gram (A) vs owner (B)", ot["owner gram"], ot["owner"]))
    print(_ratio_line("training step: muon owner (A) vs adamw (B)", st["muon"], st["adamw"]))
    print(_ratio_line("training step: muon owner gram (A) vs adamw (B)", st["muon gram"], st["adamw"]))


if __name__ == "__main__":
    main()
