"""The hardware model: matmul rate per dtype, memory, and an alpha-beta cost per collective and
link level. Frozen values, with presets built from public figures and :func:`fsdpfn.sim.measure`
fitting one on the machine at hand.

[Note: the alpha-beta collective model]
A collective of kind ``k`` over ``g`` ranks whose full buffer has ``n`` bytes takes::

    steps(k, g) * alpha + wire(k, g, n) / bandwidth

``wire`` is what one rank sends under a bandwidth-optimal (ring) algorithm, the convention of
:class:`fsdpfn.comm.CollectiveCall`: ``(g-1)/g * n`` for all-gather, reduce-scatter and
all-to-all, ``2 (g-1)/g * n`` for all-reduce. ``steps`` is the ring's number of sequential
hops: ``g - 1``, or ``2 (g - 1)`` for all-reduce. ``bandwidth`` is the bytes per second one
rank can send on that level (NCCL's "bus bandwidth"), ``alpha`` the latency of one hop. A group
whose ranks sit in one node uses the ``intra`` level. A group spanning ``n`` nodes runs as a ring
that visits the nodes in order; of its hops the fraction ``n / g`` are network hops (``inter``
alpha), the rest NVLink hops (``intra`` alpha); a group with one rank per node (HSDP's replicate
groups) is all network hops. Its bandwidth is that of the slowest level it crosses (see [Note:
the network per node]). This is :meth:`Hardware.collective_seconds`.

[Note: the network per node]
With ``Hardware.nics_per_node`` set, ``inter`` is the Link of *one network card*, and a node's
cards serve all its ranks at once. NCCL runs one ring (channel) per card, each crossing every
node boundary on its own card, and splits the buffer over them; every rank of an SPMD step runs
the same collective in its own group at the same time, so a group with ``q`` ranks on each node
gets ``q / devices_per_node`` of the node's cards. Across nodes it sends at::

    min(intra bandwidth, inter bandwidth * nics_per_node * q / devices_per_node)

per rank: an FSDP group spanning whole DGX H100 nodes (``q = 8``, 8 cards of 400 Gb/s) sends at
up to 400 GB/s, capped by NVLink inside the node; an HSDP replicate group (``q = 1``) at one
card's 50 GB/s. Without ``nics_per_node`` (0), ``inter`` is taken as one rank's bandwidth
across nodes, whatever the group. NCCL's trees (which it picks for all-reduce at scale) and
SHARP are not modelled: all-reduce is costed as a ring.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Mapping, Union, cast


from fsdpfn._wire import ring_steps, wire_bytes
from fsdpfn.sim import _rates
from fsdpfn.sim._kernels import Kernels, _dtype_key

__all__ = [
    "A100_SXM",
    "A100_SXM_40GB",
    "H100_96GB_500W",
    "H100_SXM",
    "H200_SXM",
    "KINDS",
    "Hardware",
    "Kernels",
    "Link",
    "PRESETS",
    "collective_steps",
    "wire_bytes",
]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# Each hop pays ``alpha``: the ring's hops, as the counter's bytes, come from fsdpfn._wire.
collective_steps = ring_steps


@dataclasses.dataclass(frozen=True)
class Link:
    """Alpha-beta cost of one collective kind on one link level.

    Attributes:
      alpha: seconds per ring hop (latency).
      bandwidth: bytes per second one rank sends (bus bandwidth); ``math.inf`` for a level that
        costs nothing (one rank).

    Example:
      >>> Link(alpha=1e-5, bandwidth=1e9).seconds("all_gather", 2, 2_000_000)
      0.00101
    """

    alpha: float
    bandwidth: float

    def __post_init__(self):
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise ValueError(f"Link.alpha must be a finite number of seconds >= 0, got {self.alpha!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"Link.bandwidth must be > 0 bytes/s (math.inf for free), got {self.bandwidth!r}")

    def seconds(self, kind: str, group_size: int, nbytes: float, sent: float | None = None) -> float:
        """Time of one collective: ``steps * alpha + sent / bandwidth``; ``sent`` defaults to
        :func:`wire_bytes` (pass the real bytes for uneven all-to-alls)."""
        if group_size <= 1:
            return 0.0
        sent = wire_bytes(kind, group_size, nbytes) if sent is None else sent
        return collective_steps(kind, group_size) * self.alpha + sent / self.bandwidth


LinksArg = Union[Link, Mapping[str, Link]]
# What Hardware.__post_init__ turns matmul_flops and intra / inter into: sorted (key, value) pairs.
_FlopPairs = tuple[tuple[str, float], ...]
_LinkPairs = tuple[tuple[str, Link], ...]


def _links(value: LinksArg, what: str) -> tuple[tuple[str, Link], ...]:
    """``{kind: Link}`` (``"*"``: every kind not named) or one Link for every kind, as sorted pairs."""
    if isinstance(value, Link):
        value = {"*": value}
    if isinstance(value, tuple):
        value = dict(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"Hardware.{what} must be a Link or a dict {{kind: Link}}, got {type(value).__name__}")
    out = {}
    for kind, link in value.items():
        if kind != "*" and kind not in KINDS:
            raise ValueError(
                f"Hardware.{what} names collective {kind!r}; kinds are {', '.join(KINDS)} (or '*' for all)"
            )
        if not isinstance(link, Link):
            raise ValueError(f"Hardware.{what}[{kind!r}] must be a Link, got {link!r}")
        out[kind] = link
    missing = [k for k in KINDS if k not in out and "*" not in out]
    if missing:
        raise ValueError(f"Hardware.{what} has no Link for {missing}; give them or a '*' default")
    return tuple(sorted(out.items()))


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What one device and its links can do: the simulator's only source of seconds.

    Attributes:
      name: shown in reports.
      matmul_flops: ``{dtype: FLOP/s}`` of large matmuls (``"bfloat16"``, ``"float32"``, ...);
        a dtype not listed falls back to ``"float32"``. Keys ``"attention <dtype>"`` give fused
        attention kernels their own rate (FLOPs counted as :func:`fsdpfn.sim.profile` does:
        causal attention counts half).
      memory_bandwidth: bytes/s of memory-bound (elementwise) work on one device.
      memory: bytes of memory per device (the budget a plan must fit).
      devices_per_node: ranks that share the ``intra`` links.
      intra, inter: a :class:`Link` per collective kind (or one for all) within a node and
        across nodes (see [Note: the alpha-beta collective model]).
      overlap: how well communication and compute run at once, 0..1. 1: each at full speed;
        0: they take turns (gloo on the cores that compute). Two at once take ``max + (1 -
        overlap) * min`` of their times alone. The GPU presets: 0.811, compute beside a
        collective running 18.9% slower on average (NCCL's kernels hold SMs and memory
        bandwidth; see ``fsdpfn/sim/_rates.py``).
      op_overhead: seconds every dispatched operator costs beyond its FLOPs and bytes (eager
        dispatch on CPU; ~0 where kernel launches run ahead of the device).
      kernels: a :class:`fsdpfn.sim.Kernels`: the fractions of the peaks that kernels reach and
        their fixed costs (see [Note: the kernel model] in ``fsdpfn/sim/_kernels.py``);
        ``None``: ``matmul_flops`` and ``memory_bandwidth`` are what kernels reach (fitted).
      nics_per_node: network cards per node, ``inter`` being the Link of one of them (see
        [Note: the network per node]); 0: ``inter`` is one rank's bandwidth across nodes.
      host: the :class:`Link` of host-device copies (PCIe) that offloaded units' shards and
        gradients cross; ``None``: copies at half of ``memory_bandwidth`` (read and write, as on
        a CPU, where host and device memory are one).
      host_memory_bandwidth: bytes/s of memory-bound work on the host (the optimizer step of
        offloaded units runs there); ``None``: ``memory_bandwidth``.
      memory_reserve: the caching allocator's reserve over the bytes allocated at the peak
        (fragmentation, rounding of blocks), as a fraction: ``SimResult.memory["reserved"]`` is
        ``peak * (1 + memory_reserve)``, comparable with ``torch.cuda.max_memory_reserved()``.

    Example:
      >>> hw = fsdpfn.sim.H100_SXM
      >>> hw.flops(torch.bfloat16) / 1e12, round(hw.link("all_gather", inter=True).bandwidth / 1e9, 1), hw.nics_per_node
      (989.0, 41.1, 8)
      >>> slower = hw.scaled(flops=0.5)
      >>> slower.flops("bfloat16") / 1e12
      494.5
    """

    name: str
    matmul_flops: Mapping[str, float]
    memory_bandwidth: float
    memory: int
    devices_per_node: int
    intra: LinksArg
    inter: LinksArg
    overlap: float = 1.0
    op_overhead: float = 0.0
    kernels: Kernels | None = None
    nics_per_node: int = 0
    memory_reserve: float = 0.0
    host: Link | None = None
    host_memory_bandwidth: float | None = None

    def __post_init__(self):
        flops = self.matmul_flops.items() if isinstance(self.matmul_flops, Mapping) else self.matmul_flops
        pairs = tuple(sorted((_dtype_key(k), float(v)) for k, v in flops))
        if not pairs or any(not v > 0 for _, v in pairs):
            raise ValueError(f"Hardware.matmul_flops must map dtypes to FLOP/s > 0, got {self.matmul_flops!r}")
        object.__setattr__(self, "matmul_flops", pairs)
        object.__setattr__(self, "intra", _links(self.intra, "intra"))
        object.__setattr__(self, "inter", _links(self.inter, "inter"))
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"Hardware.overlap must be in [0, 1], got {self.overlap!r}")
        if not self.memory_bandwidth > 0 or not self.memory > 0 or self.devices_per_node < 1 or self.op_overhead < 0:
            raise ValueError(
                f"Hardware {self.name!r}: memory_bandwidth and memory must be > 0, devices_per_node >= 1, op_overhead >= 0"
            )
        if self.kernels is not None and not isinstance(self.kernels, Kernels):
            raise ValueError(f"Hardware.kernels must be a fsdpfn.sim.Kernels or None, got {self.kernels!r}")
        if not isinstance(self.nics_per_node, int) or self.nics_per_node < 0:
            raise ValueError(
                f"Hardware.nics_per_node must be an int >= 0 (0: inter is one rank's bandwidth), got {self.nics_per_node!r}"
            )
        if not 0.0 <= self.memory_reserve < 1.0:
            raise ValueError(f"Hardware.memory_reserve must be a fraction in [0, 1), got {self.memory_reserve!r}")
        if self.host is not None and not isinstance(self.host, Link):
            raise ValueError(
                f"Hardware.host must be a fsdpfn.sim.Link (the PCIe link of host-device copies) or None, got {self.host!r}"
            )
        if self.host_memory_bandwidth is not None and not self.host_memory_bandwidth > 0:
            raise ValueError(
                f"Hardware.host_memory_bandwidth must be bytes/s > 0 or None, got {self.host_memory_bandwidth!r}"
            )

    def copy_seconds(self, nbytes: float) -> float:
        """Seconds of one host-device copy of ``nbytes`` (see ``host``)."""
        if self.host is None:
            return 2.0 * nbytes / self.memory_bandwidth
        return self.host.alpha + nbytes / self.host.bandwidth

    def flops(self, dtype) -> float:
        """Matmul FLOP/s in ``dtype`` (``"float32"``'s for a dtype not listed). ``"attention
        <dtype>"`` is the rate of fused attention kernels, the matmul rate when not listed."""
        table = dict(self.matmul_flops)
        key = _dtype_key(dtype).partition("@")[0]  # a shape after "@" does not change the peak
        if key in table:
            return table[key]
        if key.startswith("attention "):
            return self.flops(key.removeprefix("attention "))
        if "float32" in table:
            return table["float32"]
        raise ValueError(
            f"Hardware {self.name!r} has no matmul rate for {key} and none for float32; add it to matmul_flops"
        )

    def peak(self, dtype) -> float:
        """The datasheet (or fitted) matmul FLOP/s of ``dtype``: :meth:`flops`."""
        return self.flops(dtype)

    def kernel_seconds(self, rate: str, flops: float, nbytes: float) -> float:
        """Seconds of one matmul-like kernel (``rate``: its dtype, or ``"attention <dtype>"``)
        of ``flops`` over ``nbytes``: :meth:`Kernels.seconds`, or without kernels the roofline
        ``max(flops / rate, bytes / bandwidth)``."""
        if self.kernels is not None:
            return self.kernels.seconds(rate, flops, nbytes, self)
        return max(flops / self.flops(rate), nbytes / self.memory_bandwidth)

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds of memory-bound work moving ``nbytes``."""
        if self.kernels is not None:
            return self.kernels.memory_seconds(nbytes, self)
        return nbytes / self.memory_bandwidth

    def network_bandwidth(self, kind: str, ranks) -> float:
        """Bytes per second one rank of the group ``ranks`` sends across nodes (see [Note: the
        network per node]).

        Example:
          >>> hw = fsdpfn.sim.H100_SXM
          >>> round(hw.network_bandwidth("all_gather", range(16)) / 1e9, 1), round(hw.network_bandwidth("all_gather", range(0, 16, 8)) / 1e9, 1)
          (328.9, 41.1)
        """
        ranks = list(ranks)
        inter = self.link(kind, inter=True)
        if not self.nics_per_node:
            return inter.bandwidth
        per_node = collections.Counter(r // self.devices_per_node for r in ranks)
        q = max(per_node.values())
        return min(
            self.link(kind, inter=False).bandwidth, inter.bandwidth * self.nics_per_node * q / self.devices_per_node
        )

    def link(self, kind: str, inter: bool) -> Link:
        """The :class:`Link` of collective ``kind`` within a node (``inter=False``) or across."""
        table = dict(cast(_LinkPairs, self.inter if inter else self.intra))
        return table.get(kind) or table["*"]

    def spans_nodes(self, ranks) -> bool:
        """Whether global ``ranks`` (of one group) sit on more than one node."""
        return self.nodes(ranks) > 1

    def nodes(self, ranks) -> int:
        """How many nodes global ``ranks`` sit on."""
        return len({r // self.devices_per_node for r in ranks})

    def collective_seconds(self, kind: str, ranks, nbytes: float, sent: float | None = None) -> float:
        """Time of one collective of ``kind`` over global ``ranks`` whose full buffer has
        ``nbytes`` (see [Note: the alpha-beta collective model]).

        Example:
          >>> hw = fsdpfn.sim.H100_SXM
          >>> within, across = hw.collective_seconds("all_gather", range(8), 2**30), hw.collective_seconds("all_gather", range(16), 2**30)
          >>> round(across / within, 2)   # 8 network cards of 41.1 GB/s per node against 370 GB/s NVLink (NCCL's bus bandwidths)
          1.22
        """
        ranks = list(ranks)
        g = len(ranks)
        if g <= 1:
            return 0.0
        n = self.nodes(ranks)
        if n == 1:
            return self.link(kind, inter=False).seconds(kind, g, nbytes, sent)
        inter, intra = self.link(kind, inter=True), self.link(kind, inter=False)
        steps = collective_steps(kind, g)
        net_hops = steps * n / g
        sent = wire_bytes(kind, g, nbytes) if sent is None else sent
        return net_hops * inter.alpha + (steps - net_hops) * intra.alpha + sent / self.network_bandwidth(kind, ranks)

    def scaled(
        self, *, flops: float = 1.0, bandwidth: float = 1.0, memory_bandwidth: float = 1.0, name: str | None = None
    ) -> "Hardware":
        """A copy with every matmul rate, link bandwidth or memory bandwidth multiplied (to derate
        datasheet peaks to what kernels and NCCL reach)."""

        def scale(links):
            return {k: Link(v.alpha, v.bandwidth * bandwidth) for k, v in links}

        return dataclasses.replace(
            self,
            name=name or self.name,
            matmul_flops={k: v * flops for k, v in cast(_FlopPairs, self.matmul_flops)},
            memory_bandwidth=self.memory_bandwidth * memory_bandwidth,
            intra=scale(self.intra),
            inter=scale(self.inter),
        )

    def __str__(self) -> str:
        flops = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in cast(_FlopPairs, self.matmul_flops))
        lines = [
            f"Hardware {self.name}: {flops}; memory {self.memory / 2**30:.0f} GiB at {self.memory_bandwidth / 1e9:.3g} GB/s; "
            f"{self.devices_per_node} per node; overlap {self.overlap:.2f}; op overhead {self.op_overhead * 1e6:.1f} us"
            + (f"; {self.nics_per_node} network cards per node" if self.nics_per_node else "")
        ]
        if self.kernels is not None:
            k = self.kernels
            lines.append(
                f"  kernels: matmul {k.matmul_efficiency:.3f} of peak + {k.matmul_latency * 1e6:.1f} us, attention {k.attention_efficiency:.3f} "
                f"of peak (half at {k.attention_half_intensity:g} FLOP/B; {k.attention_flop_ratio:.3g} FLOPs run per FLOP counted), "
                f"memory {k.memory_efficiency:.2f} of bandwidth, all at {k.sustained:.3g} sustained"
            )
        for level, links in (("intra", self.intra), ("inter", self.inter)):
            for kind, link in cast(_LinkPairs, links):
                lines.append(
                    f"  {level:<5} {kind:<14} alpha {link.alpha * 1e6:8.2f} us   bandwidth {link.bandwidth / 1e9:8.3f} GB/s"
                )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Presets: datasheet peaks, and what published kernel benchmarks reach of them
# ---------------------------------------------------------------------------------------------

# NCCL's own tuning model (src/graph/tuning.cc) puts one Ring/Simple hop over NVLink at about
# 3.4 us; a hop over the network costs several microseconds more. These alphas are that order.
_NVLINK_ALPHA = 3.4e-6
_NET_ALPHA = 10e-6

# Memory: what nvidia-smi reports as the device's total (an "80 GB" H100 is 81,559 MiB), not the
# marketing gigabytes; the CUDA context takes a few hundred MiB of it outside PyTorch's pool.
_MIB = 2**20

# The caching allocator reserves more than it hands out (blocks rounded up, segments split and
# not returned): an allowance of 5% of the peak, the order by which torch.cuda's
# max_memory_reserved() exceeds max_memory_allocated() in steady FSDP training. An allowance,
# not a measurement of any one run.
_RESERVE = 0.05

# Fused attention: FlashAttention-2, the kernel behind torch's scaled_dot_product_attention on
# A100 and H100 (causal, head dim 128, bf16, forward + backward):
# - A100: about 190 TFLOP/s at 8k-16k tokens, 0.62 of 312 (Dao, 2023, "FlashAttention-2: Faster
#   Attention with Better Parallelism and Work Partitioning", arXiv 2307.08691, figure of forward
#   + backward speed on A100 80GB SXM4);
# - H100: forward 284.1 TFLOP/s (1.935 ms), backward 287.1 (4.788 ms) at batch 2 x 8192 tokens,
#   16 heads of 128, causal ("Fav2" lines of hopper/benchmark_attn.py as posted in
#   Dao-AILab/flash-attention pull request #1791, 2025-07-31): forward + backward 3.5 f / 6.723 ms
#   = 286 TFLOP/s, 0.289 of 989. FlashAttention-2 does not use Hopper's asynchronous tensor-core
#   instructions (FlashAttention-3 does: 630 forward, 532 backward in the same post). At that
#   shape the ramp below stands at 0.958 (the profile's intensity of both kernels is 2,040
#   FLOP/B), so the long-sequence figure is 0.289 / 0.958 = 0.302.
# Short sequences: about 0.6 of the long-sequence rate at 512 tokens (the FlashAttention-2
# figures). A causal bf16 forward and backward average about 0.25 * seq FLOP per byte as the
# profile counts them, so 512 tokens is ~130 FLOP/B and the half point ~90 FLOP/B.
_ATTN_HALF = 90.0
# Those rates are in the FLOPs of FlashAttention's own benchmark, which counts a forward as
# 4 b h s^2 d (half of it causal) and the backward as 2.5 forwards, forward + backward 3.5
# (Dao-AILab/flash-attention, benchmarks/benchmark_flash_attention.py, ``flops()``, at commit
# 0469c72723278048f1b1bd29f6c6155b5ef98369): the backward kernel recomputes the scores, five
# matmuls against the forward's two. The profile counts the backward as 2 forwards (torch's
# FLOP counter, the gradient matmuls only), so 3 where the benchmark counts 3.5.
_ATTN_FLOP_RATIO = 3.5 / 3.0

# Matmul: the "maximum achievable matmul FLOPS" measured with mamf-finder.py over large shapes
# (fsdpfn/sim/_rates.py names the table): A100 SXM 271.2 of 312 TFLOP/s (86.9%), H100 SXM 794.5
# of 989 (80.3%).
# A fixed 5 us per matmul kernel: a 1024^3 bf16 matmul (2.1 GFLOP) then reaches about 0.35 of
# the large-GEMM rate on H100, the order cuBLAS gives at that size. Streaming kernels: about
# 90% of the HBM bandwidth (device-to-device copy benchmarks on A100 and H100).
_MATMUL_LATENCY = 5e-6
_MEMORY_EFFICIENCY = 0.9

# Sustained: the one fitted term (see [Note: the kernel model]), fitted on the calibration set
# only: the eight A100 rows of benchmarks/sim_published.py (torchtitan's FSDP2 tables on 64 A100s,
# docs/performance.md: Llama 3 8B with layer and per-operator checkpointing, Llama 3 70B full,
# Llama 2 13B none / layer / per-operator, Llama 2 70B per-operator and full). Procedure: with it at
# 1 (``python benchmarks/sim_published.py --only calibration --raw``), take the median of those
# eight rows' predicted / published throughput and set sustained to its inverse. With the NCCL bus
# bandwidths and FlashAttention-2 head padding of fsdpfn/sim/_rates.py the eight raw ratios are
# 1.089-1.164, median 1.1037: 1 / 1.1037 = 0.906. (Before those, the same procedure gave 1.110 and
# 0.901; before the overlap slow-down and the maximum achievable matmul rates, 0.887.) Used for
# every preset; torchtitan's H100 runs (H100_96GB_500W) and every held-out row only check it.
_SUSTAINED = 0.906
_H100_KERNELS = Kernels(
    matmul_efficiency=_rates.matmul_efficiency("h100"),
    matmul_latency=_MATMUL_LATENCY,
    attention_efficiency=_rates.attention_efficiency("h100", "fa2"),
    attention_half_intensity=_ATTN_HALF,
    memory_efficiency=_MEMORY_EFFICIENCY,
    sustained=_SUSTAINED,
    attention_flop_ratio=_ATTN_FLOP_RATIO,
    matmul_shapes="h100",
    attention_kernel="fa2",
)
_A100_KERNELS = Kernels(
    matmul_efficiency=_rates.matmul_efficiency("a100"),
    matmul_latency=_MATMUL_LATENCY,
    attention_efficiency=_rates.attention_efficiency("a100", "fa2"),
    attention_half_intensity=_ATTN_HALF,
    memory_efficiency=_MEMORY_EFFICIENCY,
    sustained=_SUSTAINED,
    attention_flop_ratio=_ATTN_FLOP_RATIO,
    attention_kernel="fa2",
)

# Links at the bus bandwidth NCCL reaches of their line rate (see fsdpfn/sim/_rates.py, ``NCCL``):
# H100 NVLink 4 370 of 450 GB/s, each 400 Gb/s card 41.1 of 50; A100 NVLink 3 232.5 of 300, each
# 200 Gb/s card 21.5 of 25.
_H100_NVLINK = 450e9 * _rates.nccl_efficiency("h100", "intra")
_H100_CARD = 50e9 * _rates.nccl_efficiency("h100", "inter")
_A100_NVLINK = 300e9 * _rates.nccl_efficiency("a100", "intra")
_A100_CARD = 25e9 * _rates.nccl_efficiency("a100", "inter")

# Compute beside a collective runs 18.9% slower on average (see fsdpfn/sim/_rates.py): every GPU
# preset's ``overlap``.
_GPU_OVERLAP = _rates.OVERLAP

# Host-device copies and the host's memory (offload). PCIe 5.0 x16 (H100/H200): 64 GB/s each way,
# pinned copies reach about 55 GB/s; PCIe 4.0 x16 (A100): 32 GB/s, about 25 GB/s reached
# (bandwidthTest-style measurements). Host memory per rank: a DGX H100's two sockets of 8 DDR5-4800
# channels (614 GB/s), a DGX A100's of 8 DDR4-3200 channels (410 GB/s), shared by 8 ranks, of which
# PyTorch's CPU optimizers sustain about 0.3 (an assumption, not a published figure).
_PCIE_ALPHA = 10e-6
_PCIE5 = Link(_PCIE_ALPHA, 55e9)
_PCIE4 = Link(_PCIE_ALPHA, 25e9)
_HOST_H100 = 614e9 / 8 * 0.3
_HOST_A100 = 410e9 / 8 * 0.3

# A kernel launched back to back after another still leaves a gap of about a microsecond on the
# device; the host's dispatch (several us per operator in eager PyTorch) runs ahead of it.
_GPU_OP_OVERHEAD = 1e-6

H100_SXM = Hardware(
    name="H100 SXM (DGX H100)",
    matmul_flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float8_e4m3fn": 1979e12},
    memory_bandwidth=3.35e12,
    memory=81559 * _MIB,
    devices_per_node=8,
    intra=Link(_NVLINK_ALPHA, _H100_NVLINK),
    inter=Link(_NET_ALPHA, _H100_CARD),
    op_overhead=_GPU_OP_OVERHEAD,
    overlap=_GPU_OVERLAP,
    kernels=_H100_KERNELS,
    nics_per_node=8,
    memory_reserve=_RESERVE,
    host=_PCIE5,
    host_memory_bandwidth=_HOST_H100,
)
"""H100 SXM in DGX H100 nodes. NVIDIA H100 datasheet: 989 TFLOP/s dense BF16/FP16 Tensor Core
(1,979 with sparsity), 1,979 dense FP8, 67 TFLOP/s FP32, 80 GB HBM3 at 3.35 TB/s (81,559 MiB
as nvidia-smi reports it). NVLink 4: 900 GB/s per GPU in both directions, 450 GB/s each way.
Network: eight 400 Gb/s InfiniBand NDR ConnectX-7 cards per node, one per GPU (DGX H100), 50 GB/s
each way each. Kernels: large GEMMs at 80.3% of the BF16 peak (measured maximum achievable matmul
FLOPS), FlashAttention-2 at 30.2% (see the kernel notes in ``fsdpfn/sim/_hardware.py``)."""

H200_SXM = Hardware(
    name="H200 SXM (DGX H200)",
    matmul_flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float8_e4m3fn": 1979e12},
    memory_bandwidth=4.8e12,
    memory=143771 * _MIB,
    devices_per_node=8,
    intra=Link(_NVLINK_ALPHA, _H100_NVLINK),
    inter=Link(_NET_ALPHA, _H100_CARD),
    op_overhead=_GPU_OP_OVERHEAD,
    overlap=_GPU_OVERLAP,
    kernels=_H100_KERNELS,
    nics_per_node=8,
    memory_reserve=_RESERVE,
    host=_PCIE5,
    host_memory_bandwidth=_HOST_H100,
)
"""H200 SXM: NVIDIA H200 datasheet: the H100's Tensor Core rates (989 TFLOP/s dense BF16),
141 GB HBM3e at 4.8 TB/s (143,771 MiB); NVLink 4 (450 GB/s each way); eight 400 Gb/s NDR
InfiniBand cards per node. Kernels as the H100's (same SMs and clocks)."""

A100_SXM = Hardware(
    name="A100 SXM 80GB (DGX A100)",
    matmul_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    memory_bandwidth=2.039e12,
    memory=81920 * _MIB,
    devices_per_node=8,
    intra=Link(_NVLINK_ALPHA, _A100_NVLINK),
    inter=Link(_NET_ALPHA, _A100_CARD),
    op_overhead=_GPU_OP_OVERHEAD,
    overlap=_GPU_OVERLAP,
    kernels=_A100_KERNELS,
    nics_per_node=8,
    memory_reserve=_RESERVE,
    host=_PCIE4,
    host_memory_bandwidth=_HOST_A100,
)
"""A100 SXM 80 GB in DGX A100 nodes. NVIDIA A100 datasheet: 312 TFLOP/s dense BF16/FP16 Tensor
Core, 19.5 TFLOP/s FP32, 80 GB HBM2e at 2,039 GB/s (81,920 MiB). NVLink 3: 600 GB/s per GPU both
ways, 300 each way. Network: eight 200 Gb/s HDR InfiniBand cards per node (DGX A100), 25 GB/s
each way each. Kernels: large GEMMs at 86.9% of the BF16 peak (measured maximum achievable
matmul FLOPS), FlashAttention-2 at 62%."""

H100_96GB_500W = dataclasses.replace(
    H100_SXM,
    name="H100 SXM 96GB HBM2e 500W (Grand Teton)",
    memory_bandwidth=2.4e12,
    memory=96 * 10**9,
)
"""The H100 part of torchtitan's H100 benchmark runs (pytorch/torchtitan,
benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"): Grand Teton hosts of 8 H100 SXM
modules with 96 GB HBM2e at 2.4 TB/s, NVLink, 400 Gb/s RDMA per GPU, at a 500 W power limit.
The page gives its peak only as lying between the SXM's and the NVL's; the preset takes the SXM
module's tensor cores (the same 132-SM silicon: 989 TFLOP/s dense BF16 at boost clock) and the
H100 kernel rates, with the part's own memory and bandwidth. The 500 W limit (against 700 W)
is not modelled beyond what ``Kernels.sustained`` absorbs."""

A100_SXM_40GB = dataclasses.replace(
    A100_SXM, name="A100 SXM 40GB (DGX A100)", memory_bandwidth=1.555e12, memory=40960 * _MIB
)
"""A100 SXM 40 GB: NVIDIA A100 datasheet: the 80 GB part's Tensor Core rates (312 TFLOP/s
dense BF16), 40 GB HBM2 at 1,555 GB/s (40,960 MiB); DGX A100 links and network as ``A100_SXM``."""

PRESETS = {
    "A100_SXM": A100_SXM,
    "A100_SXM_40GB": A100_SXM_40GB,
    "H100_96GB_500W": H100_96GB_500W,
    "H100_SXM": H100_SXM,
    "H200_SXM": H200_SXM,
}
