"""Fitting a :class:`Hardware` on the machine at hand, with the collectives fsdpfn itself uses.

[Note: what measure() times]
Every rank of the default process group runs the same micro-benchmarks at the same time
(a barrier before each), and every timing is the slowest rank's (one all-reduce of all of them
at the end), so every rank fits the same numbers:

- matmul FLOP/s per dtype: square ``torch.mm``; with every rank computing at once, as in a
  training step, so ranks that share cores see their share;
- fused causal attention (``scaled_dot_product_attention`` forward and backward) at one shape,
  its FLOPs counted as :func:`fsdpfn.sim.profile` counts them: the rate of
  ``"attention <dtype>"``;
- memory bandwidth: ``torch.add(a, b, out=c)`` on 32 MiB tensors (3 x 32 MiB moved);
- operator overhead: ``torch.func.grad`` of a chain of tiny layers (8 features), per operator
  it dispatches: what an operator costs beyond its FLOPs and bytes inside a training step
  (about 25 us on this CPU, against 2 us for a bare ``torch.add``);
- per collective kind (``fsdpfn.comm.all_gather``, ``reduce_scatter`` -- on gloo the all-to-all
  plus local sum fsdpfn uses --, ``all_reduce``, ``all_to_all``): a least-squares line
  ``t = a + wire / bandwidth`` over buffer sizes, ``alpha = a / steps``
  (see [Note: the alpha-beta collective model]);
- overlap: a matmul loop alone, an all-gather alone and both at once; with ``C``, ``M`` and
  ``B`` their times, ``overlap = (C + M - B) / min(C, M)`` clipped to [0, 1].

All ranks are taken to be one node (``devices_per_node`` = the world size); the ``inter`` level
copies ``intra``. On CUDA (NCCL) the same code runs on the current device, with
synchronisation around each timing.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from typing import Sequence

import torch

from fsdpfn import comm
from fsdpfn.sim._hardware import KINDS, Hardware, Link, collective_steps, wire_bytes
from fsdpfn.sim._workload import count_work

__all__ = ["Timings", "fit_hardware", "measure", "measure_timings"]

_MIB = 2**20
_ADD_ELEMENTS = 8 * _MIB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, repeats: int, device: torch.device, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        comm.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _collective(kind: str, nbytes: int, w: int, device: torch.device):
    """``(start, full bytes)``: ``start()`` launches the collective asynchronously and returns
    its ``Pending``."""
    n = max(w, nbytes // 4 // w * w)  # float32 elements, a multiple of W
    if kind == "all_gather":
        out, inp = torch.empty(n, device=device), torch.ones(n // w, device=device)
        return (lambda: comm.all_gather(out, inp, async_op=True)), 4 * n
    if kind == "reduce_scatter":
        out, inp = torch.empty(n // w, device=device), torch.ones(n, device=device)
        return (lambda: comm.reduce_scatter(out, inp, async_op=True)), 4 * n
    if kind == "all_reduce":
        t = torch.ones(n, device=device)
        return (lambda: comm.all_reduce(t, async_op=True)), 4 * n
    out, inp = torch.empty(n, device=device), torch.ones(n, device=device)
    return (lambda: comm.all_to_all(out, inp, async_op=True)), 4 * n


def _fit(kind: str, w: int, points: Sequence[tuple[float, float]]) -> Link:
    """Least squares ``t = a + wire / bandwidth`` over ``(full bytes, seconds)`` points."""
    xs = [wire_bytes(kind, w, b) for b, _ in points]
    ts = [t for _, t in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if sxx else 0.0
    if slope <= 0:  # flat or noisy: all latency
        return Link(max(0.0, mt) / collective_steps(kind, w), math.inf)
    a = mt - slope * mx
    if a < 0:  # refit through the origin
        slope = sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs)
        a = 0.0
    return Link(a / collective_steps(kind, w), 1.0 / slope)


class Timings(dict):
    """Raw timings of one :func:`measure_timings` call (seconds, the slowest rank's), keyed by
    what was timed; :func:`fit_hardware` turns one or more of them into a :class:`Hardware`."""


def measure_timings(
    *,
    sizes_mib: tuple[float, ...] = (0.0625, 1, 4, 16),
    repeats: int = 5,
    matmul_size: int = 1024,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    attention_shape: tuple[int, int, int, int] | None = (4, 4, 128, 64),
) -> Timings:
    """Runs the micro-benchmarks of [Note: what measure() times] once (each point the median of
    ``repeats``) on every rank of the default group and returns the slowest rank's timings, the
    same on every rank. Call it on every rank, like a collective.

    Example:
      >>> t = fsdpfn.sim.measure_timings(sizes_mib=(0.0625,), repeats=1, matmul_size=64)
      >>> sorted(k.split()[0] for k in t if not k.startswith(("_", "mm", "attn")))
      ['add', 'op']
    """
    w = comm.world_size() if comm.is_initialized() else 1
    backend = comm.backend() if comm.is_initialized() else "none"
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    keys: list[str] = []
    times: list[float] = []

    def timed(key: str, fn, reps: int = repeats) -> float:
        t = _median_time(fn, reps, device)
        keys.append(key)
        times.append(t)
        return t

    # Matmul FLOP/s per dtype: n x n matmuls (smaller in slow CPU dtypes).
    for dtype in dtypes:
        n = matmul_size if (dtype == torch.float32 or device.type == "cuda") else max(64, matmul_size // 2)
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        timed(f"mm {str(dtype).removeprefix('torch.')} {n}", lambda: torch.mm(a, b))

    # Fused causal attention, forward and backward, in the first dtype: its own rate (CPU
    # flash kernels run far below matmul speed; GPU ones at a fraction of it).
    if attention_shape is not None:
        nb, h, s_, d = attention_shape
        q, k, v = (torch.randn(nb, h, s_, d, device=device).to(dtypes[0]).requires_grad_() for _ in range(3))
        g = torch.randn(nb, h, s_, d, device=device).to(dtypes[0])

        def attention():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), g)

        timed(f"attn {str(dtypes[0]).removeprefix('torch.')} {nb} {h} {s_} {d}", attention)

    # Memory bandwidth and operator overhead.
    n = _ADD_ELEMENTS
    x, y, z = torch.ones(n, device=device), torch.ones(n, device=device), torch.empty(n, device=device)
    timed("add", lambda: torch.add(x, y, out=z))
    # Operator overhead inside a training step: torch.func.grad of a chain of tiny layers (the
    # pure path's and the runtime's value_and_grad), per dispatched operator.
    tiny = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU()) for _ in range(16)]
    ).to(device)
    tiny_params = {n: p.detach() for n, p in tiny.named_parameters()}
    tiny_x = torch.randn(4, 8, device=device)
    tiny_grad = torch.func.grad(lambda ps: torch.func.functional_call(tiny, ps, (tiny_x,)).square().mean())
    tiny_ops = count_work(tiny_grad, tiny_params)[1].ops
    timed(f"op {tiny_ops}", lambda: tiny_grad(tiny_params), max(1, repeats // 2))

    if w > 1:
        for kind in KINDS:
            for mib in sizes_mib:
                start, full = _collective(kind, int(mib * _MIB), w, device)
                timed(f"{kind} {full}", lambda: start().wait())
        # Overlap: a matmul loop vs an all-gather of the largest size, alone and together.
        start, _ = _collective("all_gather", int(max(sizes_mib) * _MIB), w, device)
        a = torch.randn(matmul_size, matmul_size, device=device)
        t_ag = timed("_overlap comm", lambda: start().wait())
        t_mm1 = _median_time(lambda: torch.mm(a, a), repeats, device)
        reps = max(1, round(t_ag / max(t_mm1, 1e-9)))

        def loop():
            for _ in range(reps):
                torch.mm(a, a)

        def both():
            pending = start()
            loop()
            pending.wait()

        timed("_overlap compute", loop)
        timed("_overlap both", both)

    # The slowest rank's timings, the same on every rank.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    if w > 1:
        comm.all_reduce(t, op="max").wait()
    out = Timings(zip(keys, t.tolist()))
    out["_world"] = float(w)
    out["_memory"] = float(
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, w)
    )
    out["_cuda"] = float(device.type == "cuda")
    return out


def fit_hardware(timings: Timings | list[Timings], name: str | None = None, stat: str = "median") -> Hardware:
    """A :class:`Hardware` from :func:`measure_timings` results: each timing the median (or the
    minimum, ``stat="min"``) over the list, so that timings taken between other work, interleaved
    with it, fit the machine as that work saw it; then the fits of [Note: what measure() times].
    On a machine shared with other jobs, ``"min"`` is the least disturbed sample (interference
    only ever slows a timing down).

    Example:
      >>> hw = fsdpfn.sim.fit_hardware([fsdpfn.sim.measure_timings(repeats=1, matmul_size=64)])
      >>> hw.op_overhead > 0
      True
    """
    runs = [timings] if isinstance(timings, dict) else list(timings)
    if not runs:
        raise ValueError("fit_hardware needs at least one measure_timings() result")
    if stat not in ("median", "min"):
        raise ValueError(f"fit_hardware: stat must be 'median' or 'min', got {stat!r}")
    reduce = statistics.median if stat == "median" else min
    t = {k: reduce(r[k] for r in runs) for k in runs[0]}
    w = int(t["_world"])
    flops = {}
    for key, v in t.items():
        if key.startswith("mm "):
            _, dtype, n = key.split()
            flops[dtype] = 2.0 * int(n) ** 3 / v
        elif key.startswith("attn "):  # causal: half of 4 b h s^2 d forward, twice that backward
            _, dtype, b, h, s_, d = key.split()
            flops[f"attention {dtype}"] = 6.0 * int(b) * int(h) * int(s_) ** 2 * int(d) / v
    mem_bw = 3 * 4 * _ADD_ELEMENTS / t["add"]
    op_key = next(k for k in t if k.startswith("op "))
    op_overhead = t[op_key] / int(op_key.split()[1])  # the tiny layers' compute is negligible
    links: dict[str, Link] = {"*": Link(0.0, math.inf)}
    overlap = 1.0
    if w > 1:
        links = {}
        for kind in KINDS:
            points = [(int(k.split()[1]), v) for k, v in t.items() if k.split()[0] == kind]
            links[kind] = _fit(kind, w, points)
        t_m, t_c, t_b = t["_overlap comm"], t["_overlap compute"], t["_overlap both"]
        overlap = min(1.0, max(0.0, (t_c + t_m - t_b) / max(min(t_c, t_m), 1e-12)))
    return Hardware(
        name=name or f"measured: {w} {'nccl' if t['_cuda'] else 'gloo'} rank(s) on {platform.node() or 'this host'}",
        matmul_flops=flops,
        memory_bandwidth=mem_bw,
        memory=int(t["_memory"]),
        devices_per_node=w,
        intra=links,
        inter=links,
        overlap=overlap,
        op_overhead=op_overhead,
    )


def measure(
    *,
    sizes_mib: tuple[float, ...] = (0.0625, 1, 4, 16),
    repeats: int = 5,
    matmul_size: int = 1024,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    attention_shape: tuple[int, int, int, int] | None = (4, 4, 128, 64),
    name: str | None = None,
) -> Hardware:
    """Fits a :class:`Hardware` on the ranks of the default process group (see [Note: what
    measure() times]): ``fit_hardware(measure_timings(...))``. Call it on every rank, like a
    collective; every rank gets the same value.

    Args:
      sizes_mib: collective buffer sizes to fit the alpha-beta lines on.
      repeats: timings per point (the median is kept).
      matmul_size: ``n`` of the ``n x n`` matmuls (half of it for dtypes other than float32 on
        CPU, where bf16 matmul is slow).
      dtypes: matmul dtypes to time.
      attention_shape: ``(batch, heads, seq, head_dim)`` of the attention timed (in
        ``dtypes[0]``); ``None`` skips it (attention then runs at the matmul rate).
      name: the hardware's name (default: ranks, backend and host).

    Returns:
      a :class:`Hardware` with ``devices_per_node`` = the world size.

    Example:
      >>> hw = fsdpfn.sim.measure(sizes_mib=(0.0625, 1), repeats=1, matmul_size=128)
      >>> hw.flops(torch.float32) > 0, hw.devices_per_node   # one rank: no link to measure
      (True, 1)
    """
    timings = measure_timings(
        sizes_mib=sizes_mib, repeats=repeats, matmul_size=matmul_size, dtypes=dtypes, attention_shape=attention_shape
    )
    return fit_hardware(timings, name)
