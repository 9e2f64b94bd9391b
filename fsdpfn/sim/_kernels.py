"""The kernel model: what one GPU kernel of a training step takes, from its FLOPs and bytes.

[Note: the kernel model]
A datasheet's peak is what the tensor cores could do at their boost clock; kernels reach a
fraction of it that depends on what they compute. :class:`Kernels` holds that fraction and the
fixed costs, per device, and :meth:`Kernels.seconds` prices one operator:

- a matmul of ``m x k`` by ``k x n`` (``flops = 2 m n k``, ``bytes`` its operands and result)
  takes ``max(flops / (matmul_efficiency * peak), bytes / (memory_efficiency * bandwidth)) +
  matmul_latency``: a roofline whose compute roof is what the best-shaped large GEMMs sustain
  (the "maximum achievable matmul FLOPS", measured), plus a fixed per-kernel cost that makes
  small matmuls slow (launch, the first and last wave of tiles). A matmul of ``F`` FLOPs thus
  reaches ``F / (F + matmul_latency * rate)`` of the large-GEMM rate; :meth:`matmul_seconds`
  takes ``(m, n, k, dtype)``;
- a fused attention kernel (FlashAttention-style; its FLOPs counted as
  :func:`fsdpfn.sim.profile` counts them, causal half) runs at ``attention_efficiency`` of the
  dtype's peak at long sequences, and less at short ones: its arithmetic intensity (FLOPs per
  byte of q, k, v, output and their gradients) grows with the sequence length (about ``s / 4``
  FLOP/byte for a causal bf16 forward), and the rate is ``attention_efficiency * I / (I +
  attention_half_intensity)``: the per-tile setup and the causal diagonal weigh more when a row
  of tiles is short. Head dimension and GQA enter only through FLOPs and bytes. The published
  rates count FLOPs their own way: FlashAttention's benchmark counts the backward kernel as 2.5
  forwards (it recomputes the scores ``Q K^T`` before its four gradient matmuls: five matmuls
  against the forward's two) and a forward + backward as 3.5, where the profile counts the
  backward as 2 (torch's FLOP counter: the gradient matmuls only), 3 in all. A kernel therefore
  takes ``attention_flop_ratio * flops / rate`` (3.5 / 3 for a rate taken from that benchmark's
  forward + backward figure): the rate applies to the FLOPs the kernels execute;
- where the profile knows a matmul's shape (its rate key carries ``@m x n x k``, see
  :func:`fsdpfn._flops.rate_key`) and the part has a measured table by shape
  (``matmul_shapes``, :func:`fsdpfn.sim._rates.matmul_shape_efficiency`), the table's
  throughput for that shape replaces ``matmul_efficiency`` and the fixed latency (the table timed
  whole kernels, launch and partial waves included);
- a fused attention kernel whose head dimension the kernel class pads (FlashAttention-2 runs a
  head of 112 in its 128 kernel: ``attention_kernel="fa2"``) executes the padded FLOPs;
- every other operator is memory-bound: ``bytes / (memory_efficiency * bandwidth)``;
- every dispatched operator costs ``Hardware.op_overhead`` on top (the framework's dispatch and
  launch; a GPU runs ahead of the host, so it is small there);
- all of the above run at ``sustained`` of those rates through a whole training step: the
  kernel benchmarks run one kernel at a time at boost clocks, a training step runs for seconds
  at the power limit with NCCL's kernels holding SMs beside the compute. This is the one term
  the presets *fit*: the median ratio of published to predicted throughput over the calibration
  runs of ``benchmarks/sim_published.py`` (torchtitan's FSDP2 runs; never over the held-out
  runs), the same value for every preset.

Without a :class:`Kernels` (``Hardware.kernels=None``: CPU hardware fitted by
:func:`fsdpfn.sim.measure`) a matmul takes ``max(flops / rate, bytes / bandwidth)`` and the
rates are taken as given.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fsdpfn._flops import split_key
from fsdpfn.sim import _rates

__all__ = ["Kernels"]


def _dtype_key(dtype) -> str:
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype)


def _itemsize(key: str) -> int:
    """Bytes per element of dtype name ``key`` (``"bfloat16"`` -> 2)."""
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {key!r}: give a torch dtype or its name ('bfloat16', 'float32', ...)")
    return dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Achieved fractions of a device's peaks and fixed per-kernel costs (see [Note: the kernel
    model]).

    Attributes:
      matmul_efficiency: fraction of ``Hardware.matmul_flops`` that large, well-shaped GEMMs
        sustain (measured maximum achievable matmul FLOPS over the datasheet peak).
      matmul_latency: seconds every matmul kernel costs beyond its FLOPs (launch, wave
        quantisation of small problems).
      attention_efficiency: fraction of the dtype's peak a fused attention kernel reaches at long
        sequences, forward and backward together.
      attention_half_intensity: arithmetic intensity (FLOP per byte, FLOPs as the profile
        counts them) at which attention reaches half of that rate.
      attention_flop_ratio: FLOPs the ``attention_efficiency`` figure counts per FLOP the
        profile counts (FlashAttention's benchmark: 3.5 / 3 for forward + backward, see
        [Note: the kernel model]); 1: the same convention.
      memory_efficiency: fraction of ``Hardware.memory_bandwidth`` that streaming kernels reach.
      sustained: fraction of all those rates a whole training step sustains (clocks under the
        power limit, SMs shared with communication kernels); 1: the kernels' own benchmarks.
      matmul_shapes: the part whose measured GEMM table by shape prices matmuls of known shape
        (``"h100"``; ``""``: none, ``matmul_efficiency`` for every shape).
      attention_kernel: the fused attention kernel class (``"fa2"``, ``"fa3"``; ``""``: no
        head-dimension padding).

    Example:
      >>> k = Kernels(matmul_efficiency=0.8, matmul_latency=5e-6, attention_efficiency=0.4,
      ...             attention_half_intensity=100.0, memory_efficiency=0.9)
      >>> hw = fsdpfn.sim.Hardware("toy", {"bfloat16": 1e15}, 1e12, 2**30, 1, fsdpfn.sim.Link(0, 1e9), fsdpfn.sim.Link(0, 1e9), kernels=k)
      >>> round(k.matmul_seconds(8192, 8192, 8192, "bfloat16", hw) * 1e3, 4)   # 1.1e12 FLOPs at 0.8 PFLOP/s, + 5 us
      1.3794
    """

    matmul_efficiency: float
    matmul_latency: float
    attention_efficiency: float
    attention_half_intensity: float
    memory_efficiency: float
    sustained: float = 1.0
    attention_flop_ratio: float = 1.0
    matmul_shapes: str = ""
    attention_kernel: str = ""

    def __post_init__(self):
        for name in ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "sustained"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"Kernels.{name} must be a fraction in (0, 1], got {v!r}")
        if not (self.attention_flop_ratio > 0 and math.isfinite(self.attention_flop_ratio)):
            raise ValueError(
                f"Kernels.attention_flop_ratio must be a finite number > 0, got {self.attention_flop_ratio!r}"
            )
        for name in ("matmul_latency", "attention_half_intensity"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"Kernels.{name} must be a finite number >= 0, got {v!r}")

    def memory_seconds(self, nbytes: float, hw) -> float:
        """Seconds of memory-bound work moving ``nbytes``."""
        return nbytes / (self.sustained * self.memory_efficiency * hw.memory_bandwidth)

    def attention_rate(self, dtype: str, flops: float, nbytes: float, hw) -> float:
        """FLOP/s of a fused attention kernel of ``flops`` over ``nbytes`` in ``dtype``."""
        intensity = flops / nbytes if nbytes > 0 else math.inf
        ramp = 1.0 if math.isinf(intensity) else intensity / (intensity + self.attention_half_intensity)
        return self.sustained * self.attention_efficiency * hw.peak(dtype) * ramp

    def matmul_fraction(self, dtype: str, shape: tuple[int, ...]) -> tuple[float, bool]:
        """``(fraction of the peak, from the shape table)`` of a matmul of ``shape`` (``(m, n,
        k)`` or ``()``) in ``dtype``, before ``sustained``."""
        if self.matmul_shapes and len(shape) == 3:
            eff = _rates.matmul_shape_efficiency(self.matmul_shapes, dtype, *shape)
            if eff is not None:
                return eff, True
        return self.matmul_efficiency, False

    def seconds(self, rate: str, flops: float, nbytes: float, hw) -> float:
        """Seconds of one matmul-like kernel: ``rate`` is its dtype (``"bfloat16"``) or
        ``"attention <dtype>"``, with ``"@<shape>"`` where known (see [Note: the kernel model])."""
        rate, shape = split_key(rate)
        memory = self.memory_seconds(nbytes, hw)
        if rate.startswith("attention "):
            executed = self.attention_flop_ratio * flops
            if self.attention_kernel and len(shape) == 3 and shape[2]:
                executed *= _rates.attention_head_dim(self.attention_kernel, shape[2]) / shape[2]
            return (
                max(executed / self.attention_rate(rate.removeprefix("attention "), flops, nbytes, hw), memory)
                + self.matmul_latency
            )
        fraction, tabled = self.matmul_fraction(rate, shape)
        latency = 0.0 if tabled else self.matmul_latency
        return max(flops / (self.sustained * fraction * hw.peak(rate)), memory) + latency

    def matmul_seconds(self, m: int, n: int, k: int, dtype, hw) -> float:
        """Seconds of an ``(m x k) @ (k x n)`` matmul in ``dtype`` (operands and result read and
        written once)."""
        key = _dtype_key(dtype)
        return self.seconds(f"{key}@{m}x{n}x{k}", 2.0 * m * n * k, (m * k + k * n + m * n) * _itemsize(key), hw)

    def achieved(self, m: int, n: int, k: int, dtype, hw) -> float:
        """FLOP/s an ``(m x k) @ (k x n)`` matmul reaches: the efficiency curve of this device."""
        return 2.0 * m * n * k / self.matmul_seconds(m, n, k, dtype, hw)
