"""Fitting a :class:`Hardware` on the machine at hand, with the collectives fsdpfn itself uses.

[Note: what measure() times]
Every rank of the default process group runs the same micro-benchmarks at the same time
(a barrier before each), and every timing is the slowest rank's (one all-reduce of all of them
at the end), so every rank fits the same numbers:

- matmul FLOP/s per dtype: square ``torch.mm``; with every rank computing at once, as in a
  training step, so ranks that share cores see their share;
- memory bandwidth: ``torch.add(a, b, out=c)`` on 32 MiB tensors (3 x 32 MiB moved);
- operator overhead: a tiny ``torch.add`` repeated, per call;
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

import torch

from fsdpfn import comm
from fsdpfn.sim._hardware import KINDS, Hardware, Link, collective_steps, wire_bytes

__all__ = ["measure"]

_MIB = 2**20


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


def _fit(kind: str, w: int, points: list[tuple[float, float]]) -> Link:
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


def measure(
    *,
    sizes_mib: tuple[float, ...] = (0.0625, 1, 4, 16),
    repeats: int = 5,
    matmul_size: int = 1024,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    name: str | None = None,
) -> Hardware:
    """Fits a :class:`Hardware` on the ranks of the default process group (see [Note: what
    measure() times]). Call it on every rank, like a collective; every rank gets the same value.

    Args:
      sizes_mib: collective buffer sizes to fit the alpha-beta lines on.
      repeats: timings per point (the median is kept).
      matmul_size: ``n`` of the ``n x n`` matmuls (half of it for dtypes other than float32 on
        CPU, where bf16 matmul is slow).
      dtypes: matmul dtypes to time.
      name: the hardware's name (default: ranks, backend and host).

    Returns:
      a :class:`Hardware` with ``devices_per_node`` = the world size.

    Example:
      >>> hw = fsdpfn.sim.measure(sizes_mib=(0.0625, 1), repeats=1, matmul_size=128)
      >>> hw.flops(torch.float32) > 0, hw.devices_per_node   # one rank: no link to measure
      (True, 1)
    """
    w = comm.world_size() if comm.is_initialized() else 1
    backend = comm.backend() if comm.is_initialized() else "none"
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    times: list[float] = []

    # Matmul FLOP/s per dtype.
    flop_sizes = []
    for dtype in dtypes:
        n = matmul_size if (dtype == torch.float32 or device.type == "cuda") else max(64, matmul_size // 2)
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        times.append(_median_time(lambda: torch.mm(a, b), repeats, device))
        flop_sizes.append(2.0 * n**3)

    # Memory bandwidth and operator overhead.
    n = 8 * _MIB
    x, y, z = torch.ones(n, device=device), torch.ones(n, device=device), torch.empty(n, device=device)
    times.append(_median_time(lambda: torch.add(x, y, out=z), repeats, device))
    s1, s2, s3 = torch.ones(1, device=device), torch.ones(1, device=device), torch.empty(1, device=device)
    calls = 2000

    def tiny():
        for _ in range(calls):
            torch.add(s1, s2, out=s3)

    times.append(_median_time(tiny, max(1, repeats // 2), device))

    # Collectives.
    points = {k: [] for k in KINDS}
    if w > 1:
        for kind in KINDS:
            for mib in sizes_mib:
                start, full = _collective(kind, int(mib * _MIB), w, device)
                points[kind].append(full)
                times.append(_median_time(lambda: start().wait(), repeats, device))
        # Overlap: a matmul loop vs an all-gather of the largest size, alone and together.
        start, _ = _collective("all_gather", int(max(sizes_mib) * _MIB), w, device)
        a = torch.randn(matmul_size, matmul_size, device=device)
        t_ag = _median_time(lambda: start().wait(), repeats, device)
        t_mm1 = _median_time(lambda: torch.mm(a, a), repeats, device)
        reps = max(1, round(t_ag / max(t_mm1, 1e-9)))

        def loop():
            for _ in range(reps):
                torch.mm(a, a)

        def both():
            pending = start()
            loop()
            pending.wait()

        times += [t_ag, _median_time(loop, repeats, device), _median_time(both, repeats, device)]

    # The slowest rank's timings, the same on every rank.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    if w > 1:
        comm.all_reduce(t, op="max").wait()
    times = t.tolist()

    it = iter(times)
    flops = {str(d).removeprefix("torch."): f / next(it) for d, f in zip(dtypes, flop_sizes)}
    mem_bw = 3 * 4 * n / next(it)
    op_overhead = max(0.0, next(it) / calls - 3 * 4 / mem_bw)
    links: dict[str, Link] = {}
    overlap = 1.0
    if w > 1:
        for kind in KINDS:
            links[kind] = _fit(kind, w, [(full, next(it)) for full in points[kind]])
        t_m, t_c, t_b = next(it), next(it), next(it)
        overlap = min(1.0, max(0.0, (t_c + t_m - t_b) / max(min(t_c, t_m), 1e-12)))
    else:
        links = {"*": Link(0.0, math.inf)}
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, w)
    return Hardware(
        name=name or f"measured: {w} {backend} rank(s) on {platform.node() or 'this host'}",
        matmul_flops=flops,
        memory_bandwidth=mem_bw,
        memory=int(memory),
        devices_per_node=w,
        intra=links,
        inter=links,
        overlap=overlap,
        op_overhead=op_overhead,
    )
