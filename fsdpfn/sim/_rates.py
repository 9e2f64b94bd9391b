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
- the slow-down of compute kernels while a collective runs beside them on the same GPU.
"""

from __future__ import annotations

__all__ = ["ATTENTION_KERNELS", "OVERLAP", "OVERLAP_SLOWDOWN", "attention_efficiency", "matmul_efficiency"]

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
        raise ValueError(f"no published maximum achievable matmul rate for {dtype} on {arch!r}; "
                         f"known: {sorted(_MAMF)}") from None


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
        raise ValueError(f"no published rate for attention kernel {kernel!r} on {arch!r}; "
                         f"known: {sorted(ATTENTION_KERNELS)}") from None


# Compute beside communication: Lee et al., 2025, "Characterizing Compute-Communication Overlap
# in GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114): compute kernels run on
# average 18.9% slower while a collective runs beside them (NCCL's kernels hold SMs and memory
# bandwidth). In the timeline engine's terms (fsdpfn/sim/_engine.py, [Note: sharing]) work that
# overlaps runs at 1 / (2 - overlap) of its speed, so overlap = 1 - 0.189.
OVERLAP_SLOWDOWN = 0.189
OVERLAP = 1.0 - OVERLAP_SLOWDOWN
