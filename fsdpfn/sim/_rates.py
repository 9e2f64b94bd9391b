"""Published kernel and interconnect rates, one source each, that the presets are built from.

[Note: published rates]
Every figure here is what a public benchmark measured, named beside it; nothing in this module
is fitted. The presets of ``fsdpfn/sim/_hardware.py`` read them through :func:`matmul_efficiency`,
:func:`attention_efficiency` and :data:`OVERLAP_SLOWDOWN`:

- the best-shape matmul rate per part and dtype (the "maximum achievable matmul FLOPS" that
  ``mamf-finder.py`` finds by sweeping shapes), as a fraction of the datasheet's dense peak;
- the fused-attention rate per part and *kernel class*: FlashAttention-2 (``"fa2"``: the kernel
  behind ``torch.nn.functional.scaled_dot_product_attention``'s flash backend and flash-attn 2.x)
  and FlashAttention-3 (``"fa3"``: Hopper's asynchronous tensor-core instructions). Which
  kernel a published run used is read from its configuration, not assumed: see
  ``benchmarks/sim_published.py``;
- the slow-down of compute kernels while a collective runs beside them on the same GPU;
- matmul throughput *by shape* (:func:`matmul_shape_efficiency`: a measured table, interpolated);
- the head dimension FlashAttention-2 computes at (:func:`attention_head_dim`);
- the bus bandwidth NCCL reaches of a link's line rate (:func:`nccl_efficiency`).
"""

from __future__ import annotations

import bisect
import math

__all__ = [
    "ATTENTION_KERNELS",
    "MATMUL_SHAPES",
    "NCCL",
    "OVERLAP",
    "OVERLAP_SLOWDOWN",
    "attention_efficiency",
    "attention_head_dim",
    "matmul_efficiency",
    "matmul_shape_efficiency",
    "nccl_efficiency",
]

# Maximum achievable matmul FLOPS: stas00/ml-engineering, compute/accelerator/README.md, table
# "Maximum Achievable Matmul FLOPS comparison table" (measured with
# compute/accelerator/benchmarks/mamf-finder.py, sweeping m, n, k for the best-shaped GEMM),
# TFLOP/s measured against the datasheet's dense peak:
#   H100 SXM BF16: 794.5 of 989 (80.3%); A100 SXM BF16: 271.2 of 312 (86.9%);
#   H100 SXM FP8 (e4m3): 1402.6 of 1979 (70.9%).
# An A100 40GB and 80GB share the SMs and clocks (one figure for both); an H200 the H100's.
_MAMF = {
    ("h100", "bfloat16"): 794.5 / 989.0,
    ("h100", "float16"): 794.5 / 989.0,
    ("h100", "float8_e4m3fn"): 1402.6 / 1979.0,
    ("a100", "bfloat16"): 271.2 / 312.0,
    ("a100", "float16"): 271.2 / 312.0,
}


def matmul_efficiency(arch: str, dtype: str = "bfloat16") -> float:
    """Fraction of the dense peak the best-shaped ``dtype`` GEMMs reach on ``arch``
    (``"h100"``, ``"a100"``).

    Example:
      >>> round(matmul_efficiency("h100"), 3), round(matmul_efficiency("a100"), 3)
      (0.803, 0.869)
    """
    try:
        return _MAMF[(arch, dtype)]
    except KeyError:
        raise ValueError(
            f"no published maximum achievable matmul rate for {dtype} on {arch!r}; known: {sorted(_MAMF)}"
        ) from None


# Fused attention, causal, head dimension 128, bf16, forward + backward, as a fraction of the
# dense BF16 peak, in the FLOPs of FlashAttention's own benchmark (a forward as 4 b h s^2 d,
# half of it causal; the backward as 2.5 forwards: see [Note: the kernel model] in _kernels.py):
# - FlashAttention-2 on A100: about 190 TFLOP/s at 8k-16k tokens, 0.62 of 312 (Dao, 2023,
#   "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", arXiv
#   2307.08691, figure of forward + backward speed on A100 80GB SXM4);
# - FlashAttention-2 on H100: forward 284.1 TFLOP/s (1.935 ms), backward 287.1 (4.788 ms) at
#   batch 2 x 8192 tokens, 16 heads of 128 ("Fav2" lines of hopper/benchmark_attn.py as posted
#   in Dao-AILab/flash-attention pull request #1791): 3.5 f / 6.723 ms = 286 TFLOP/s, 0.289 of
#   989, and 0.302 once the intensity ramp of _kernels.py (0.958 at that shape) is taken out;
# - FlashAttention-3 on H100: forward 630, backward 532 TFLOP/s at the same shape (the same
#   post): 3.5 / (1 / 630 + 2.5 / 532) = 557 TFLOP/s, 0.563 of 989, 0.588 without the ramp.
#   (Shah et al., 2024, "FlashAttention-3", arXiv 2407.08608: up to 740 TFLOP/s, 75% of peak,
#   for the FP16 forward alone at its best shape.)
# The kernel benchmark's shape: batch 2, 16 heads of 128, 8,192 tokens, causal; its FLOPs in its
# own convention, forward + backward: 3.5 x 4 b h s^2 d / 2.
_BENCH_FLOPS = 3.5 * 4.0 * 2 * 16 * 8192 * 8192 * 128 / 2
# At that shape the profile counts 2,040 FLOP per byte of attention, where the intensity ramp of
# _kernels.py (half rate at 90 FLOP/B) stands at 2040 / 2130: the long-sequence figure is the
# benchmark's rate over that.
_RAMP_AT_8K = 2040.0 / (2040.0 + 90.0)
ATTENTION_KERNELS = {
    ("a100", "fa2"): 0.62,
    ("h100", "fa2"): _BENCH_FLOPS / (1.935e-3 + 4.788e-3) / 989e12 / _RAMP_AT_8K,
    ("h100", "fa3"): 3.5 / (1.0 / 630.0 + 2.5 / 532.0) / 989.0 / _RAMP_AT_8K,
}


def attention_efficiency(arch: str, kernel: str = "fa2") -> float:
    """Fraction of the dense BF16 peak a fused attention ``kernel`` (``"fa2"``, ``"fa3"``)
    reaches on ``arch`` at long sequences, forward and backward.

    Example:
      >>> round(attention_efficiency("h100", "fa2"), 3), round(attention_efficiency("h100", "fa3"), 3)
      (0.302, 0.588)
    """
    try:
        return ATTENTION_KERNELS[(arch, kernel)]
    except KeyError:
        raise ValueError(
            f"no published rate for attention kernel {kernel!r} on {arch!r}; known: {sorted(ATTENTION_KERNELS)}"
        ) from None


# Compute beside communication: Lee et al., 2025, "Characterizing Compute-Communication Overlap
# in GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114): compute kernels run on
# average 18.9% slower while a collective runs beside them (NCCL's kernels hold SMs and memory
# bandwidth). In the timeline engine's terms (fsdpfn/sim/_engine.py, [Note: sharing]) work that
# overlaps runs at 1 / (2 - overlap) of its speed, so overlap = 1 - 0.189.
OVERLAP_SLOWDOWN = 0.189
OVERLAP = 1.0 - OVERLAP_SLOWDOWN


# Matmul throughput by shape on H100: XLA's measured GEMM table, tensorflow/tensorflow at commit
# 9bebee8e429eea3a9a0cfcbd989f1aa6a470c15d, third_party/xla/xla/service/gpu/model/
# matmul_interpolator_data.h, ``kDefaultMatmulPTable``, key "sm_90" (its sibling
# hlo_op_profiles_data.h names the sm_90 device "NVIDIA H100 80GB HBM3"), "bf16xbf16->bf16" FLOP/s
# of a (b, m, n, k) batched GEMM. Kept here: the points the profiled models' matmuls fall between,
# TFLOP/s by (rows, cols, k), rows = b * m (the table's b = 2 and 4 at m = 4096 stand for 8,192 and
# 16,384 rows: as many output tiles), cols = n. Its best point, 808.7, sits beside ml-engineering's
# maximum achievable 794.5 (the _MAMF table above).
_XLA_SM90_BF16 = {
    (1024, 1024, 1024): 236.3,
    (1024, 1024, 2048): 350.0,
    (1024, 1024, 4096): 470.1,
    (2048, 1024, 1024): 373.3,
    (2048, 1024, 2048): 523.3,
    (2048, 1024, 4096): 653.1,
    (2048, 2048, 1024): 493.9,
    (2048, 2048, 2048): 632.0,
    (2048, 2048, 4096): 738.0,
    (4096, 1024, 1024): 488.1,
    (4096, 1024, 2048): 632.0,
    (4096, 1024, 4096): 738.5,
    (4096, 2048, 1024): 593.2,
    (4096, 2048, 2048): 716.1,
    (4096, 2048, 4096): 758.4,
    (4096, 4096, 1024): 677.4,
    (4096, 4096, 2048): 738.7,
    (4096, 4096, 4096): 783.3,
    (8192, 1024, 1024): 598.2,
    (8192, 1024, 2048): 713.4,
    (8192, 1024, 4096): 750.6,
    (8192, 2048, 1024): 680.9,
    (8192, 2048, 2048): 733.3,
    (8192, 2048, 4096): 783.2,
    (8192, 4096, 1024): 693.0,
    (8192, 4096, 2048): 763.0,
    (8192, 4096, 4096): 807.7,
    (16384, 1024, 1024): 673.8,
    (16384, 1024, 2048): 720.5,
    (16384, 1024, 4096): 777.6,
    (16384, 2048, 1024): 687.9,
    (16384, 2048, 2048): 759.3,
    (16384, 2048, 4096): 808.7,
    (16384, 4096, 1024): 725.5,
    (16384, 4096, 2048): 764.6,
    (16384, 4096, 4096): 793.1,
}
MATMUL_SHAPES = {("h100", "bfloat16"): (_XLA_SM90_BF16, 989.0), ("h100", "float16"): (_XLA_SM90_BF16, 989.0)}


def _axis(points, x: float) -> tuple[float, float, float]:
    """``(lo, hi, t)``: the grid points around ``x`` (clipped to the grid) and the weight of ``hi``
    in log2 space."""
    x = min(max(x, points[0]), points[-1])
    i = min(bisect.bisect_left(points, x), len(points) - 1)
    if points[i] == x or i == 0:
        return points[i], points[i], 0.0
    lo, hi = points[i - 1], points[i]
    return lo, hi, math.log2(x / lo) / math.log2(hi / lo)


def matmul_shape_efficiency(arch: str, dtype: str, m: int, n: int, k: int) -> float | None:
    """Fraction of the dense peak an ``(m x k) @ (k x n)`` ``dtype`` GEMM reaches on ``arch``,
    interpolated in log2 of each dimension on the measured table (``None``: no table for them).
    ``m`` and ``n`` are interchangeable (a GEMM and its transpose); dimensions beyond the table
    are clipped to it (larger GEMMs sit at its top, where throughput has levelled off).

    Example:
      >>> round(matmul_shape_efficiency("h100", "bfloat16", 4096, 4096, 4096), 3)   # 783.3 of 989
      0.792
      >>> round(matmul_shape_efficiency("h100", "bfloat16", 16384, 1536, 1536), 3)   # small inner dimension
      0.726
    """
    found = MATMUL_SHAPES.get((arch, dtype))
    if found is None:
        return None
    table, peak = found
    rows_grid = sorted({r for r, _, _ in table})
    cols_grid = sorted({c for _, c, _ in table})
    ks = sorted({kk for _, _, kk in table})
    rows, cols = max(m, n), min(m, n)

    def at(r, c, kk):
        return table.get((r, c, kk)) or table[(c, r, kk)]  # below 4,096 rows the table is kept with rows >= cols

    r0, r1, tr = _axis(rows_grid, rows)
    c0, c1, tc = _axis(cols_grid, cols)
    k0, k1, tk = _axis(ks, k)
    total = 0.0
    for r, wr in ((r0, 1 - tr), (r1, tr)):
        for c, wc in ((c0, 1 - tc), (c1, tc)):
            for kk, wk in ((k0, 1 - tk), (k1, tk)):
                if wr * wc * wk:
                    total += wr * wc * wk * at(r, c, kk)
    return total / peak


# FlashAttention-2 runs a kernel compiled for a fixed head dimension: flash_api.cpp
# (Dao-AILab/flash-attention, csrc/flash_attn/flash_api.cpp, ``head_size_rounded =
# round_multiple(head_size, head_size <= 128 ? 32 : 64)`` and the per-head-dim kernels
# flash_fwd_hdim{32,64,96,128,160,192,224,256}): a head of 112 (MPT-30B: 7168 / 64) runs the
# 128 kernel, 128/112 of the FLOPs counted.
def attention_head_dim(kernel: str, head_dim: int) -> int:
    """The head dimension ``kernel`` computes at for heads of ``head_dim``.

    Example:
      >>> attention_head_dim("fa2", 112), attention_head_dim("fa2", 128), attention_head_dim("fa2", 80)
      (128, 128, 96)
    """
    if kernel != "fa2":
        return head_dim
    step = 32 if head_dim <= 128 else 64
    return -(-head_dim // step) * step


# NCCL's bus bandwidth against a link's line rate: NVIDIA's NCCL maintainer (S. Jeaugey,
# NVIDIA/nccl-tests issue #212, 2024-05-06): "450GB/s is the line rate. With the protocol overhead
# (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when
# running non-allreduce operations" (H100, 8 GPUs; issue #326, 2025-06-24: "360 GB/s is exactly
# what we'd expect on H100"). A100: one DGX-class node's all_reduce_perf at 232.54 GB/s bus
# bandwidth of NVLink 3's 300 (NVIDIA/nccl-tests issue #175, 2023-10-29), and two nodes at 86 of
# their cards' 100 GB/s (same issue). Across nodes on H100 the same protocol overhead is taken
# (no published per-card figure for 400 Gb/s NDR at hand): 370 / 450.
NCCL = {
    ("h100", "intra"): 370.0 / 450.0,
    ("h100", "inter"): 370.0 / 450.0,
    ("a100", "intra"): 232.54 / 300.0,
    ("a100", "inter"): 86.0 / 100.0,
}


def nccl_efficiency(arch: str, level: str) -> float:
    """Fraction of the line rate NCCL's collectives reach as bus bandwidth on ``arch``'s
    ``level`` (``"intra"``: NVLink, ``"inter"``: the network cards).

    Example:
      >>> round(nccl_efficiency("h100", "intra") * 450, 1)
      370.0
    """
    try:
        return NCCL[(arch, level)]
    except KeyError:
        raise ValueError(f"no published NCCL bus bandwidth for {arch!r} {level!r}; known: {sorted(NCCL)}") from None
