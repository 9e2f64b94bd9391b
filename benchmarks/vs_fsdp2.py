"""fsdpfn's runtime vs torch FSDP2 (``fully_shard``), side by side on 2 gloo ranks.

Same GPT-style model, same initial weights, same batch, interleaved step by step (A B A B ...)
in one launch with one thread per rank, for zero2 and zero3, fp32 and bf16-params/fp32-reduce.
Prints per configuration: the median of the pair-by-pair step-time ratio fsdpfn / FSDP2 with its
min-max spread, bytes per rank per step for both against the theory, collective counts, and the
peak-resident-memory ratio (each side measured in a fresh 2-rank launch per configuration). A
first table compares gloo's native reduce-scatter with fsdpfn's all-to-all + local sum, which
picks fsdpfn's CPU reduce-scatter path.

With ``--compile``: five sides interleaved, fsdpfn eager (the runtime), fsdpfn compiled whole-step
(``fsdpfn.compile``), fsdpfn per-unit compiled (``Runtime.compile_units``: the runtime's schedule
around each block's compiled forward), FSDP2 eager and FSDP2 with each block compiled
(torchtitan's per-block recipe), with each side's first step (where it compiles) reported apart.

Usage:
  OMP_NUM_THREADS=1 python benchmarks/vs_fsdp2.py                # 25 measured steps each
  OMP_NUM_THREADS=1 python benchmarks/vs_fsdp2.py --compile --steps 12   # compiled vs eager
  OMP_NUM_THREADS=1 python benchmarks/vs_fsdp2.py --steps 3 --warmup 1 --width 128   # smoke run

bf16 on this kind of CPU (no native bf16 matmul) runs the full-size model at ~70 s per step on
either side (fp32: ~2 s), so 25 interleaved bf16 steps at full size take about two hours; the
README's bf16 rows come from ``--configs zero2:bf16,zero3:bf16 --width 128 --vocab 1024 --seq 64``.

A step is forward, ``loss.backward()``, and a plain SGD update of the sharded parameters on both
sides (fsdpfn: ``rt.apply`` + backward into the shards' ``.grad``; FSDP2: ``model(x)`` +
backward + ``torch.optim.SGD``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdpfn.launch import launch

ALL_CONFIGS = ["zero2:fp32", "zero3:fp32", "zero2:bf16", "zero3:bf16"]
CONFIGS: list[tuple[str, str]] = []
WORLD = 2


# ---------------------------------------------------------------------------------------------
# Counting FSDP2's collectives: wrap the torch.distributed functions it calls
# ---------------------------------------------------------------------------------------------


class _Fsdp2Counter:
    """Counts calls and bytes of ``dist.all_gather_single``/``reduce_scatter_single``/
    ``all_reduce`` while active (FSDP2 looks them up on ``torch.distributed`` at call time;
    fsdpfn binds its own references at import, so it is not counted twice)."""

    NAMES = {
        "all_gather_single": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "all_reduce": "all_reduce",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
    }

    def __init__(self):
        self.active = False
        self.calls: dict[str, int] = {}
        self.wire: dict[str, float] = {}
        for name, kind in self.NAMES.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn, kind))

    def _wrap(self, fn, kind):
        def wrapped(*args, **kwargs):
            if self.active:
                group = kwargs.get("group")
                w = dist.get_world_size(group)
                tensors = [a for a in list(args[:2]) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                big = max(tensors, key=lambda t: t.numel())
                nbytes = big.numel() * big.element_size()
                factor = 2.0 if kind == "all_reduce" else 1.0
                self.calls[kind] = self.calls.get(kind, 0) + 1
                self.wire[kind] = self.wire.get(kind, 0.0) + factor * (w - 1) / w * nbytes
            return fn(*args, **kwargs)

        return wrapped

    @contextlib.contextmanager
    def counting(self):
        self.calls, self.wire, self.active = {}, {}, True
        try:
            yield self
        finally:
            self.active = False


# ---------------------------------------------------------------------------------------------
# The two sides
# ---------------------------------------------------------------------------------------------


def _cfg(args):
    from fsdpfn.models import GPTConfig

    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, width=args.width, depth=args.depth, heads=args.heads)


def _batch(args, rank):
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.vocab, (WORLD * args.batch, args.seq + 1), generator=gen)
    mine = tokens[rank * args.batch : (rank + 1) * args.batch]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def _ce(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


class FsdpfnSide:
    name = "fsdpfn"

    def __init__(self, model, mesh, strategy, precision, lr):
        import fsdpfn
        from fsdpfn.runtime import Runtime

        mp_ = fsdpfn.MixedPrecision(torch.bfloat16, torch.float32) if precision == "bf16" else None
        self.plan = fsdpfn.plan(model, mesh, strategy=strategy, mp=mp_)
        self.params = fsdpfn.shard(model, self.plan, requires_grad=True)
        model.to("meta")  # the runtime never reads the module's own parameters: free them
        self.rt = Runtime(model, self.plan, prefetch=1)
        self.lr = lr

    def step(self, x, y):
        loss = _ce(self.rt.apply(self.params, x), y)
        loss.backward()
        with torch.no_grad():
            for p in self.params.values():
                p._local_tensor.sub_(self.lr * p.grad._local_tensor)
                p.grad = None
        return loss.item()

    def count(self, x, y):
        import fsdpfn

        with fsdpfn.count_collectives() as c:
            self.step(x, y)
        return c.counts(), c.wire_bytes()


class Fsdp2Side:
    name = "FSDP2"

    def __init__(self, model, mesh, strategy, precision, lr, counter):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if precision == "bf16" else MixedPrecisionPolicy()
        raf = strategy == "zero3"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=raf, mp_policy=policy)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
        self.counter = counter

    def step(self, x, y):
        loss = _ce(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def count(self, x, y):
        with self.counter.counting() as c:
            self.step(x, y)
        return dict(c.calls), dict(c.wire)


class FsdpfnCompiledSide(FsdpfnSide):
    """fsdpfn's whole step compiled: ``fsdpfn.compile`` of the loss over ``rt.apply`` (one forward
    and one backward graph, every collective inside, scheduled by inductor)."""

    name = "fsdpfn compiled"

    def __init__(self, model, mesh, strategy, precision, lr, overlap=False):
        import fsdpfn

        super().__init__(model, mesh, strategy, precision, lr)
        self.params = {n: p.detach() for n, p in self.params.items()}
        rt = self.rt
        self.compiled = fsdpfn.compile(lambda params, x, y: _ce(rt.apply(params, x), y), overlap=overlap)
        if overlap:
            self.name = "fsdpfn compiled + overlap passes"

    def step(self, x, y):
        grads, loss = self.compiled(self.params, x, y)
        with torch.no_grad():
            for n, p in self.params.items():
                p._local_tensor.sub_(self.lr * grads[n]._local_tensor)
        return loss.item()


def _build(side, args, strategy, precision, mesh, counter):
    from fsdpfn.models import GPT

    torch.manual_seed(0)
    model = GPT(_cfg(args))
    if side == "fsdpfn":
        return FsdpfnSide(model, mesh, strategy, precision, args.lr)
    if side == "fsdpfn per-unit compiled":  # the runtime's schedule around each block's compiled forward
        out = FsdpfnSide(model, mesh, strategy, precision, args.lr)
        out.rt.compile_units()
        out.name = side
        return out
    if side.startswith("fsdpfn compiled"):
        return FsdpfnCompiledSide(model, mesh, strategy, precision, args.lr, overlap="overlap" in side)
    if side == "FSDP2 per-block compiled":  # torchtitan's recipe: compile each block, then fully_shard
        for block in model.blocks:
            block.compile(fullgraph=True)
        out = Fsdp2Side(model, mesh, strategy, precision, args.lr, counter)
        out.name = side
        return out
    return Fsdp2Side(model, mesh, strategy, precision, args.lr, counter)


def _param_bytes(args, dtype_bytes):
    from fsdpfn.models import GPT

    with torch.device("meta"):
        model = GPT(_cfg(args))
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


# ---------------------------------------------------------------------------------------------
# Rank programs
# ---------------------------------------------------------------------------------------------


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _time_collectives(reps=10):
    """gloo reduce-scatter: native (an all-reduce inside) vs all-to-all + local sum."""
    from fsdpfn import comm

    out = []
    for mib in (4, 16):
        n = mib * 2**20 // 4
        x = torch.randn(n)
        res = torch.empty(n // WORLD)
        row = {"MiB": mib}
        for impl in ("native", "all_to_all"):
            times = []
            for _ in range(reps):
                dist.barrier()
                t = time.perf_counter()
                comm.reduce_scatter(res, x, impl=impl)
                times.append(time.perf_counter() - t)
            row[impl] = statistics.median(times)
        out.append(row)
    return out


def _timing_rank(rank, world, args):
    CONFIGS[:] = [tuple(c.split(":")) for c in args.configs.split(",")]
    mesh = _mesh()
    counter = _Fsdp2Counter()
    results = {"collectives": _time_collectives()}
    x, y = _batch(args, rank)
    for strategy, precision in CONFIGS:
        sides = [_build(s, args, strategy, precision, mesh, counter) for s in ("fsdpfn", "FSDP2")]
        losses = {s.name: [] for s in sides}
        for _ in range(args.warmup):
            for s in sides:
                s.step(x, y)
        times = {s.name: [] for s in sides}
        for i in range(args.steps):
            order = sides if i % 2 == 0 else sides[::-1]  # A B, B A: neither side always goes first
            for s in order:
                dist.barrier()
                t = time.perf_counter()
                losses[s.name].append(s.step(x, y))
                times[s.name].append(time.perf_counter() - t)
        counts = {s.name: s.count(x, y) for s in sides}
        hw = sides[0].rt.memory.high_water
        results[(strategy, precision)] = {"times": times, "counts": counts, "losses": losses, "high_water": hw}
        if rank == 0:
            print(f"  [{strategy} {precision}: done]", flush=True)
        del sides
    return results


COMPILE_SIDES = ["fsdpfn", "fsdpfn compiled", "fsdpfn per-unit compiled", "FSDP2", "FSDP2 per-block compiled"]
OVERLAP_SIDE = "fsdpfn compiled + overlap passes"


_MATMULS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
)


def _matmul_floor(side, x, y, reps=3):
    """Seconds one step's matmul-like operators take alone on this rank: every ``mm``, ``addmm``,
    ``bmm`` and fused-attention call of one eager step of ``side``, recorded with its shapes,
    strides and arguments, then replayed on fresh tensors (best of ``reps``, ranks together).
    No compiler can make the step faster than this: inductor hands these operators to the same
    library kernels and only fuses what lies between them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in _MATMULS:
                spec = [("t", a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else ("v", a) for a in args]
                calls.append((func, spec, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Record():
        side.step(x, y)
    replay = [
        (func, [torch.empty_strided(a[1], a[2], dtype=a[3]).normal_() if a[0] == "t" else a[1] for a in spec], kw)
        for func, spec, kw in calls
    ]
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        for func, args_, kw in replay:
            func(*args_, **kw)
        best = min(best, time.perf_counter() - t)
    return best, len(calls)


def _compile_rank(rank, world, args):
    """The four sides of ``--compile``, interleaved in a rotating order; the first step of each
    side (where compilation happens) is timed apart."""
    import warnings

    warnings.simplefilter("ignore")  # dynamo's and inductor's own warnings
    CONFIGS[:] = [tuple(c.split(":")) for c in args.configs.split(",")]
    if args.inductor_overlap and OVERLAP_SIDE not in COMPILE_SIDES:
        COMPILE_SIDES.append(OVERLAP_SIDE)
    mesh = _mesh()
    counter = _Fsdp2Counter()
    x, y = _batch(args, rank)
    results = {}
    for strategy, precision in CONFIGS:
        sides = [_build(s, args, strategy, precision, mesh, counter) for s in COMPILE_SIDES]
        first, losses = {}, {s.name: [] for s in sides}
        for s in sides:
            dist.barrier()
            t = time.perf_counter()
            losses[s.name].append(s.step(x, y))
            first[s.name] = time.perf_counter() - t
        for _ in range(args.warmup):
            for s in sides:
                s.step(x, y)
        times = {s.name: [] for s in sides}
        for i in range(args.steps):
            k = i % len(sides)
            for s in sides[k:] + sides[:k]:  # every side goes first as often
                dist.barrier()
                t = time.perf_counter()
                losses[s.name].append(s.step(x, y))
                times[s.name].append(time.perf_counter() - t)
        counts = {s.name: s.count(x, y) for s in sides}
        floor = _matmul_floor(sides[0], x, y)
        results[(strategy, precision)] = {
            "times": times,
            "first": first,
            "losses": losses,
            "counts": counts,
            "floor": floor,
        }
        if rank == 0:
            print(f"  [{strategy} {precision}: done]", flush=True)
        del sides
    return results


def _report_compile(res, args):
    if args.inductor_overlap and OVERLAP_SIDE not in COMPILE_SIDES:
        COMPILE_SIDES.append(OVERLAP_SIDE)
    print(
        f"\nwhole-step compile ({args.steps} measured steps after {args.warmup} warm-up, rotating order); "
        "step-time ratios, median [min-max] of pair-by-pair ratios (slower rank of each step):"
    )
    for strategy, precision in CONFIGS:
        r = [res[k][(strategy, precision)] for k in sorted(res)]
        t = {s: [max(x["times"][s][i] for x in r) for i in range(args.steps)] for s in COMPILE_SIDES}
        print(f"  {strategy} {precision}:")
        pairs = [
            ("fsdpfn compiled", "FSDP2"),
            ("fsdpfn compiled", "FSDP2 per-block compiled"),
            ("fsdpfn compiled", "fsdpfn"),
            ("fsdpfn per-unit compiled", "FSDP2 per-block compiled"),
            ("fsdpfn per-unit compiled", "FSDP2"),
            ("fsdpfn per-unit compiled", "fsdpfn"),
            ("FSDP2 per-block compiled", "FSDP2"),
            ("fsdpfn", "FSDP2"),
        ]
        if OVERLAP_SIDE in COMPILE_SIDES:
            pairs += [(OVERLAP_SIDE, "fsdpfn compiled"), (OVERLAP_SIDE, "FSDP2")]
        for a, b in pairs:
            ratios = [x / y for x, y in zip(t[a], t[b])]
            print(f"    {a} / {b}: {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")
        base = statistics.median(t["FSDP2"])
        for s in COMPILE_SIDES:
            first = max(x["first"][s] for x in r)
            print(
                f"    {s}: first step (compiles) {first:.1f} s = {first / base:.0f}x an FSDP2 eager step; "
                f"collectives {_fmt_counts(r[0]['counts'][s][0])}"
            )
        floor = max(x["floor"][0] for x in r)
        print(
            f"    matmul floor ({r[0]['floor'][1]} matmul and attention calls of one step, replayed alone): {floor:.3f} s "
            f"= {floor / base:.2f}x an FSDP2 eager step (median {base:.3f} s); no compiled step can be faster"
        )
        gap = max(abs(a - b) for a, b in zip(r[0]["losses"]["fsdpfn compiled"], r[0]["losses"]["fsdpfn"]))
        print(f"    max |loss compiled - loss eager| (fsdpfn) over steps: {gap:.2e}")


def _memory_rank(rank, world, args, side, strategy, precision):
    mesh = _mesh()
    counter = _Fsdp2Counter()
    x, y = _batch(args, rank)
    s = _build(side, args, strategy, precision, mesh, counter)
    for _ in range(args.memory_steps):
        s.step(x, y)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _launch(target, *args):
    """Both ranks in fresh processes (a fresh launch per peak-memory measurement), one thread each."""
    return dict(enumerate(launch(target, WORLD, *args)))


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _fmt_counts(c):
    return ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sorted(c.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--memory-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument(
        "--memory-configs",
        default=None,
        help="comma-separated strategy:precision whose peak memory is "
        "measured, each in fresh launches (default: every one of --configs)",
    )
    ap.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated strategy:precision (default {','.join(ALL_CONFIGS)}; with --compile zero3:fp32)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="fsdpfn compiled whole-step vs fsdpfn eager vs FSDP2 "
        "eager vs FSDP2 with per-block compile, instead of the default tables",
    )
    ap.add_argument(
        "--inductor-overlap",
        action="store_true",
        help="with --compile: a fifth side, fsdpfn compiled "
        "with inductor's comm/compute reordering passes (fsdpfn.compile(..., overlap=True))",
    )
    args = ap.parse_args()
    args.configs = args.configs or ("zero3:fp32" if args.compile else ",".join(ALL_CONFIGS))
    CONFIGS[:] = [tuple(c.split(":")) for c in args.configs.split(",")]

    print("command:", "OMP_NUM_THREADS=1 python " + " ".join(sys.argv))
    print(
        f"model: GPT width {args.width}, {args.depth} blocks, vocab {args.vocab}, seq {args.seq}, "
        f"batch {args.batch}/rank; {WORLD} gloo ranks, 1 thread each; torch {torch.__version__}"
    )
    if args.compile:
        _report_compile(_launch(_compile_rank, args), args)
        return
    res = _launch(_timing_rank, args)
    r0 = res[0]

    print("\ngloo reduce-scatter (fp32, rank 0, median of 10):")
    print("  buffer   native (all-reduce inside)   all-to-all + local sum")
    for row in r0["collectives"]:
        print(
            f"  {row['MiB']:>3} MiB   {row['native'] * 1e3:>10.1f} ms               {row['all_to_all'] * 1e3:>10.1f} ms"
        )

    peak = {}
    if not args.skip_memory:
        measured = [tuple(c.split(":")) for c in args.memory_configs.split(",")] if args.memory_configs else CONFIGS
        for strategy, precision in measured:
            for side in ("fsdpfn", "FSDP2"):
                out = _launch(_memory_rank, args, side, strategy, precision)
                peak[(strategy, precision, side)] = max(out.values()) / 1024  # MiB (ru_maxrss is KiB)

    print(f"\nper configuration ({args.steps} measured steps after {args.warmup} warm-up, interleaved):")
    header = (
        "config",
        "fsdpfn/FSDP2 median [min-max]",
        "fsdpfn s",
        "FSDP2 s",
        "MiB/rank/step fsdpfn | FSDP2 | theory",
        "peak RSS fsdpfn/FSDP2",
        "unsharded high-water",
    )
    print("  " + " | ".join(header))
    detail = []
    for strategy, precision in CONFIGS:
        r = [res[k][(strategy, precision)] for k in sorted(res)]
        # ratio pair by pair, per rank, then the slower rank of each pair (a step ends when both do)
        ta = [max(x["times"]["fsdpfn"][i] for x in r) for i in range(args.steps)]
        tb = [max(x["times"]["FSDP2"][i] for x in r) for i in range(args.steps)]
        ratios = [a / b for a, b in zip(ta, tb)]
        gbytes = 2 if precision == "bf16" else 4
        psi_g, psi_r = _param_bytes(args, gbytes), _param_bytes(args, 4)
        gathers = 2 if strategy == "zero3" else 1
        theory = (gathers * psi_g + psi_r) * (WORLD - 1) / WORLD
        mine_c, mine_w = r[0]["counts"]["fsdpfn"]
        theirs_c, theirs_w = r[0]["counts"]["FSDP2"]
        mem = peak.get((strategy, precision, "fsdpfn")), peak.get((strategy, precision, "FSDP2"))
        mem_s = f"{mem[0] / mem[1]:.2f} ({mem[0]:.0f}/{mem[1]:.0f} MiB)" if mem[0] else "-"
        mib = 2**20
        print(
            f"  {strategy} {precision} | {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] | "
            f"{statistics.median(ta):.3f} | {statistics.median(tb):.3f} | "
            f"{sum(mine_w.values()) / mib:.1f} | {sum(theirs_w.values()) / mib:.1f} | {theory / mib:.1f} "
            f"({'3' if gathers == 2 else '2'}x) | {mem_s} | {r[0]['high_water'] / mib:.1f} MiB"
        )
        loss_gap = max(abs(a - b) for a, b in zip(r[0]["losses"]["fsdpfn"], r[0]["losses"]["FSDP2"]))
        detail.append(
            f"  {strategy} {precision}: fsdpfn {_fmt_counts(mine_c)}; FSDP2 {_fmt_counts(theirs_c)}; "
            f"max |loss fsdpfn - loss FSDP2| over steps {loss_gap:.2e}"
        )
    print("\ncollective calls per step (rank 0):")
    print("\n".join(detail))
    print(
        f"\ntheory: zero2 (Psi_g + Psi_r)(W-1)/W, zero3 (2 Psi_g + Psi_r)(W-1)/W, Psi_g/Psi_r = parameter "
        f"bytes in the gather/reduce dtype ({_param_bytes(args, 4) / 2**20:.1f} MiB fp32). fsdpfn's default schedule keeps "
        "the root gathered from forward to backward (its backward starts where its forward ends); FSDP2 regathers it, "
        "so fsdpfn's zero3 moves one root all-gather less than 3x."
    )


if __name__ == "__main__":
    main()
