"""The plan's value types: frozen, validated data describing how a model is sharded.

A plan is data. It names the units (groups of parameters gathered and reduced together), each
unit's strategy and flat-buffer layout, the mesh's named axes and their roles, every parameter's
tensor-parallel placement, and the mixed-precision policy. The transforms
(:mod:`fsdpfn.transforms`) and the runtime only read it; nothing here talks to other ranks. The
builder (:func:`fsdpfn.plan`) lives in ``builder.py``, JSON in ``encode.py`` and ``serialise.py``.

[Note: flat-buffer layout]
A unit's sharded parameters travel in one flat buffer per rank, so a unit costs one all-gather
and one reduce-scatter however many parameters it holds. Each parameter is split along dim 0
with ``torch.chunk`` semantics over the W ranks of the shard axis: chunks of ``c = ceil(rows/W)``
rows, the last ones shorter or empty (5 rows over 4 ranks: 2, 2, 1, 0), the same split DTensor's
``Shard(0)`` uses. Every rank reserves ``c * row_numel`` elements for the parameter at the same
offset, zero-padding its own chunk to that size. After an all-gather the W segments stacked as
``(W, shard_numel)`` hold, for each parameter, ``W * c`` rows whose first ``rows`` are the
parameter in order, so unpacking is one strided copy per parameter, with no per-rank
bookkeeping.

Under tensor parallelism "the parameter" above is its *tensor-parallel-local* part
(:attr:`ParamSpec.local_shape`: the global shape cut by its placements, e.g. ``Shard(d)`` over
``tp`` divides dim ``d`` by the tp degree; see ``fsdpfn/_plan/placements.py``):
data-parallel rows are cut from the slice this rank's tp position owns, as FSDP2 does on a 2-D
mesh. Rows, elements and bytes of units are all counted on that local shape.

Parameters that cannot be split along dim 0 (0-d tensors) are replicated. They are not gathered,
and their gradients ride in the reduce-scatter buffer once in *every* rank's segment, so the
reduce-scatter hands every rank the sum: an all-reduce folded into the same collective.

[Note: expert units]
On a mesh with an ``ep`` axis (expert parallelism) the packed expert weights of a
mixture-of-experts layer (``[experts, ...]``) are split along dim 0 over ``ep`` (their
placement ``Shard(0)`` on ``ep``, where every other parameter is ``Replicate()``): like a tensor-parallel split, each rank's "parameter" is its ``experts / ep`` experts
(:attr:`ParamSpec.local_shape`), and its rows over the data-parallel ``shard`` axis (the expert
data-parallel axis, ``edp``) are cut from that part: rows are experts, so each ``edp`` rank holds
whole experts (none, when a rank's experts are fewer than ``edp``). They form their own unit per layer
(``Unit.experts``), gathered and reduced over ``edp`` only: an expert's gradient on the rank
holding it already sums every ``ep`` rank's tokens (the all-to-all's backward). Every other unit
is sharded over ``ep`` x ``edp`` flattened into one group, and every gradient is averaged over all
``ep`` x ``edp`` ranks, which each read their own batch. A replicate axis (the first mesh dim)
holds whole copies of that layout: every unit's gradient is also all-reduced over it, and tokens
travel over ``ep`` within each replica. A ``cp`` axis (after ``ep`` and ``edp``) is one more
data-parallel axis that splits nothing: expert units are sharded over ``edp`` x ``cp`` and the
others over ``ep`` x ``edp`` x ``cp``, each flattened; tokens travel over ``ep`` among the ranks
of one cp position (each routes its own part of every sequence), and every gradient is averaged
over ``ep`` x ``edp`` x ``cp`` (``plan.grad_ranks``).

[Note: fused colwise]
A colwise Linear gives tp rank ``r`` the ``r``-th of ``tp`` blocks of its output features. That
is right when the features are head-major (each head's q, k and v rows together, as
:class:`fsdpfn.models.GPT`'s ``qkv`` lays them out and splits them with ``view(..., -1, 3, hd)``),
and wrong when they are k parts side by side (``q, k, v = qkv(x).chunk(3, -1)``, HF GPT-2's
layout): rank 0 would get all of q and half of k. ``"colwise_fused:k"`` splits each part
separately (Megatron's ``partition_stride``, DTensor's ``_StridedShard(0, split_factor=k)`` on
the tp axis): rank ``r`` holds ``[q_r; k_r; v_r]``, so ``chunk(k, -1)`` of its local output gives
its q, k and v of ``heads / tp`` heads each. Its parameters are placed ``StridedShard(0, k)``
on ``tp`` (in the compatibility words, ``tp="shard0"`` with ``tp_stride=k``). Data-parallel rows cut from that local part would straddle the
parts in a way no DTensor placement describes, so such a parameter is not sharded over a
data-parallel axis (yet): its unit replicates it, or that axis has one rank.

[Note: FP8 gather layout]
A unit whose weights gather in FP8 (``Unit.fp8``, chosen by ``MixedPrecision(fp8=...)``) still
makes one all-gather, of bytes: each rank's segment holds, for every sharded parameter, the same
``chunk_rows`` rows as above, either in ``param_dtype`` (1-D and excluded parameters) or as E4M3
bytes (one per element) plus the recipe's scales for those rows (:class:`Float8Layout`). Regions
are ordered by alignment (``param_dtype`` and float32 scales first, bytes last) and the segment is
padded to that alignment, so every region can be viewed in its dtype in place after the gather.
Rows are whole on one rank and block scales run along the last dim, so the gathered bytes are
the bytes of quantizing the whole weight (see [Note: rows are whole] in :mod:`fsdpfn.fp8`).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import json
import math
from typing import Any, Sequence

import torch
import torch.distributed

from fsdpfn._plan import placements as P
from fsdpfn._plan.axes import MeshAxes, Role
from fsdpfn._plan.encode import _dtype_name, plan_fingerprint, plan_to_dict
from fsdpfn._plan.placements import AxisPlacement
from fsdpfn._plan.tp_styles import TP_FUSED_PREFIX, style_names, style_row, tp_style
from fsdpfn._rows import chunk_bounds, chunk_size
from fsdpfn._codec import GatherCodec, ReduceCodec, cached, codec_factories
from fsdpfn._remat import check_policy
from fsdpfn.fp8 import ByteSlot, Float8Codec, Float8GatherPolicy, Float8Layout, as_gather_policy

__all__ = [
    "MixedPrecision",
    "ParamSpec",
    "Unit",
    "PlanValues",
    "Strategy",
    "STRATEGIES",
    "TP_STYLES",
    "TP_MODULE_STYLES",
    "REMAT_POLICIES",
    "ROOT",
    "ROOT_LABEL",
    "chunk_bounds",
    "chunk_size",
    "unit_label",
    "Float8Layout",
    "ByteSlot",
    "Slot",
]

# The root unit (the model's own parameters, outside every other unit) has the empty name; it is
# shown and accepted in strategy dicts as ROOT_LABEL.
ROOT = ""
ROOT_LABEL = "<root>"


def unit_label(name: str) -> str:
    """How a unit name is shown: its FQN, or ``"<root>"`` for the root unit."""
    return name or ROOT_LABEL


class Strategy(str, enum.Enum):
    """How a unit is sharded over the data-parallel shard axis. A ``str`` enum: it compares equal
    to its name (``unit.strategy == "zero3"``) and is written as that name in JSON.

    ============  ===========  =====================  ==========================================
    strategy      params       full grads kept        gathers per micro-batch
    ============  ===========  =====================  ==========================================
    replicate     whole        no (all-reduced)       0
    zero1         sharded      yes, summed over the   1; reduced once per step (micro-batches
                               step's micro-batches   accumulate locally)
    zero2         sharded      no                     1: kept gathered from forward to backward
    zero3         sharded      no                     2: resharded after forward, gathered again
    ============  ===========  =====================  ==========================================

    Example:
      >>> Strategy("zero3").reshards_after_forward, Strategy.ZERO1.keeps_full_grads
      (True, True)
    """

    REPLICATE = "replicate"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"

    @property
    def sharded(self) -> bool:
        """Parameters (and optimizer state) are sharded over the shard axis."""
        return self is not Strategy.REPLICATE

    @property
    def reshards_after_forward(self) -> bool:
        """Unsharded parameters are freed after forward and gathered again for backward."""
        return self is Strategy.ZERO3

    @property
    def keeps_full_grads(self) -> bool:
        """Micro-batches sum full gradients locally and reduce once per step (ZeRO-1), whatever
        the runtime's ``accumulate``."""
        return self is Strategy.ZERO1

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


STRATEGIES = tuple(s.value for s in Strategy)
# The words ParamSpec(tp=...) and plan JSON use for a parameter's tp placement (Shard(0),
# Shard(1), Replicate(), Partial() in fsdpfn/_plan/placements.py): split along dim 0 (a colwise
# Linear's weight and bias), along dim 1 (a rowwise Linear's weight), replicated, or replicated
# and used as a partial sum (a rowwise Linear's bias: added on tp position 0 only, so the
# all-reduce after the matmul adds it once).
TP_STYLES = ("replicate", "shard0", "shard1", "partial")
# Tensor-parallel styles of a module (Plan.tp): the rows of fsdpfn/_plan/tp_styles.py.
TP_MODULE_STYLES = style_names()


# Activation checkpointing of a unit (Unit.remat): keep its activations, keep only its inputs and
# recompute its forward in backward, or keep some results too (see [Note: selective
# rematerialisation]); "save_names:..." and registered policies are accepted besides these.
REMAT_POLICIES = ("none", "full", "save_dots")
HSDP_DIM_NAMES = ("replicate", "shard")
_FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_from(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in plan JSON")
    return dtype


def _as_dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return _dtype_from(value.removeprefix("torch."))
    raise ValueError(f"{what} must be a torch.dtype or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Mixed-precision policy. fp32 (or the model's own dtype) masters are always kept.

    Attributes:
      param_dtype: dtype parameters are gathered and computed in (``None``: their own dtype).
      reduce_dtype: dtype gradients are reduced in (``None``: ``param_dtype``, else their own).
      fp8: gather the weights in FP8 (``None``: off): ``True`` or ``"mxfp8"`` (MXFP8 on every
        >= 2-D non-embedding weight), ``"blockwise"``, ``"tensorwise"``, an
        :mod:`fsdpfn.fp8` recipe, or a :class:`fsdpfn.fp8.Float8GatherPolicy`. Weights are
        quantized from the master cast to ``param_dtype`` and used dequantized to
        ``param_dtype``; gradients (in ``reduce_dtype``) flow straight through to the masters.
      codec: the name of codecs given to :func:`fsdpfn.register_codec` that pack units' gathers
        and reduces (``None``: the built-in ones, see [Note: codec selection] in
        ``fsdpfn/_codec.py``).

    Example:
      >>> MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
      MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
      >>> MixedPrecision(param_dtype=torch.bfloat16, fp8="mxfp8").fp8.recipe
      MXFP8BlockScaling(scale_mode='rceil')
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    fp8: Float8GatherPolicy | None = None
    codec: str | None = None

    def __post_init__(self):
        if self.codec is not None and (not isinstance(self.codec, str) or not self.codec):
            raise ValueError(
                f"MixedPrecision.codec must be the name of a registered codec (str) or None, got {self.codec!r}"
            )
        object.__setattr__(self, "param_dtype", _as_dtype(self.param_dtype, "MixedPrecision.param_dtype"))
        object.__setattr__(self, "reduce_dtype", _as_dtype(self.reduce_dtype, "MixedPrecision.reduce_dtype"))
        object.__setattr__(self, "fp8", as_gather_policy(self.fp8))
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {dtype}")

    def __repr__(self) -> str:
        fp8 = "" if self.fp8 is None else f", fp8={self.fp8!r}"
        codec = "" if self.codec is None else f", codec={self.codec!r}"
        return f"MixedPrecision(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}{fp8}{codec})"


def _check_mesh_covers_world(mesh, pp: int = 1) -> None:
    """Refuses a live mesh with fewer ranks than the job: ranks outside it would fail on their
    first shard while the ones inside trained without them. Every rank knows both sizes, so
    every rank refuses, before any collective. (Checkpoints and non-finite checks also agree
    over every process, so a plan's mesh must be all of them.)"""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    world, size = torch.distributed.get_world_size(), mesh.mesh.numel() * pp  # a stage's mesh: one pp rank's part
    if size != world:
        shape = tuple(mesh.mesh.shape)
        names = f", mesh_dim_names={tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
        raise ValueError(
            f"the mesh {shape} has {size} rank{'s' if size != 1 else ''}, but this job has world size {world} "
            f"(torch.distributed.get_world_size()); every process must be in the plan's mesh. Build it over all of them, "
            f"e.g. init_device_mesh('cpu', {(world,)}{names if len(shape) == 1 else ''}) (or 'cuda'; the product of the mesh's "
            "dims must equal the world size), or start the job with as many processes as the mesh has ranks"
        )


@dataclasses.dataclass(frozen=True, init=False)
class ParamSpec:
    """One parameter: its path in the model, global shape, (master) dtype and its placement on
    each model-parallel mesh axis.

    Attributes:
      name: the parameter's path in the model.
      shape: its global shape.
      dtype: its master dtype.
      placements: one ``AxisPlacement`` (:mod:`fsdpfn._plan.placements`) per model-parallel axis it is placed on
        (``tp``, ``ep``), in the vocabulary of DTensor: ``Shard(d)`` (split along dim ``d``: a
        colwise Linear's rows, a rowwise one's columns, a packed expert weight's experts over
        ``ep``), ``StridedShard(0, k)`` (a ``colwise_fused:k`` Linear, see [Note: fused
        colwise]), ``Partial()`` (replicated; in forward, position 0 uses it and the others use
        zeros, so a sum over the axis adds it once: a rowwise bias), ``Replicate()`` (the default,
        not listed). Everything derived from them (local shape and part, groups, DTensor
        placements, JSON) comes from :mod:`fsdpfn._plan.placements`.

    ``ParamSpec(name, shape, dtype, tp=..., tp_size=..., expert=..., ep_size=..., tp_stride=...)``
    (the form before placements, positional or by keyword) still builds the same placements, and
    :attr:`tp`, :attr:`tp_size`, :attr:`tp_stride`, :attr:`tp_dim`, :attr:`expert` and
    :attr:`ep_size` read them back for compatibility (read-only; fsdpfn itself asks the
    placements).

    ``local_shape``, ``rows``, ``row_numel`` and ``numel`` describe the model-parallel-local
    part, which is what a unit gathers over the data-parallel axis.

    Example:
      >>> p = ParamSpec("fc.weight", (256, 64), torch.float32, tp="shard0", tp_size=2)
      >>> p.placements
      (AxisPlacement('tp', 2, Shard(0)),)
      >>> p.local_shape, p.rows, p.numel, p.global_numel
      ((128, 64), 128, 8192, 16384)
      >>> from fsdpfn._plan.placements import AxisPlacement, Shard
      >>> p == ParamSpec("fc.weight", (256, 64), torch.float32, placements=[AxisPlacement("tp", 2, Shard(0))])
      True
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[AxisPlacement, ...] = ()

    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        tp: str | None = None,
        tp_size: int | None = None,
        expert: bool | None = None,
        ep_size: int | None = None,
        tp_stride: int | None = None,
        *,
        placements: Sequence[AxisPlacement] | None = None,
    ):
        legacy = [
            k
            for k, v in (
                ("tp", tp),
                ("tp_size", tp_size),
                ("expert", expert),
                ("ep_size", ep_size),
                ("tp_stride", tp_stride),
            )
            if v is not None
        ]
        if placements is not None and legacy:
            raise ValueError(f"parameter {name!r}: give placements= or the words {legacy}, not both")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        object.__setattr__(self, "dtype", dtype)
        if placements is None:  # the words before placements: what they meant
            entries = P.from_legacy(
                name,
                tp or "replicate",
                1 if tp_size is None else tp_size,
                bool(expert),
                1 if ep_size is None else ep_size,
                1 if tp_stride is None else tp_stride,
            )
        else:
            entries = P.normalise(placements)
        object.__setattr__(self, "placements", entries)
        P.check(self)

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's model-parallel part (the global shape cut by each axis's
        placement)."""
        return P.local_shape(self)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def global_numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.local_shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.local_shape[1:]) if self.shape else 1

    # ---- compatibility: the words before placements (read-only, derived) --------------------

    @property
    def tp(self) -> str:
        """Compatibility: the tp placement as a :data:`TP_STYLES` word (``"replicate"``,
        ``"shard0"``, ``"shard1"``, ``"partial"``; a strided split is ``"shard0"``)."""
        return P.legacy_fields(self)["tp"]

    @property
    def tp_size(self) -> int:
        """Compatibility: ranks on the tensor-parallel axis the parameter was placed for."""
        return P.axis_size(self, Role.TP)

    @property
    def tp_stride(self) -> int:
        """Compatibility: fused parts of a ``StridedShard`` tp placement (1 otherwise)."""
        return P.placement_of(self, Role.TP).parts

    @property
    def tp_dim(self) -> int | None:
        """Compatibility: the dim split over the tensor-parallel axis, or ``None``."""
        return P.placement_of(self, Role.TP).dim

    @property
    def expert(self) -> bool:
        """Compatibility: a packed expert weight (split along dim 0 over ``ep``)."""
        return P.placement_of(self, Role.EP).is_split

    @property
    def ep_size(self) -> int:
        """Compatibility: ranks on the expert-parallel axis the parameter was placed for."""
        return P.axis_size(self, Role.EP)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one parameter sits in its unit's flat buffers (see [Note: flat-buffer layout]).

    Attributes:
      offset: start of the parameter in each rank's segment.
      chunk_rows: rows per rank (``ceil(rows / W)``) for a sharded parameter; ``rows`` if replicated.
      size: elements reserved per rank (``chunk_rows * row_numel``).
      sharded: ``False`` for replicated parameters (0-d, or the ``replicate`` strategy).
    """

    offset: int
    chunk_rows: int
    size: int
    sharded: bool


@dataclasses.dataclass(frozen=True)
class Unit:
    """A group of parameters gathered and reduced together: one module's own parameters.

    Attributes:
      name: the module's FQN in the model (``""`` for the root).
      strategy: a :class:`Strategy` (``replicate``, ``zero1``, ``zero2``, ``zero3``; a str works).
      params: the parameters, in registration order.
      shard_size: ranks on the shard axis (``W``).
      fp8: the parameters gathered in FP8 (see [Note: FP8 gather layout]); ``()``: none.
      remat: activation checkpointing of the unit's forward: ``"none"`` (keep its activations
        for backward), ``"full"`` (keep only its inputs and recompute its forward in backward, on
        the parameters gathered for backward), ``"save_dots"`` (keep matmul outputs too),
        ``"save_names:a,b"`` (keep the tensors tagged with :func:`fsdpfn.checkpoint_name`) or a
        policy given to :func:`fsdpfn.register_remat_policy`.
      offload: keep the unit's sharded parameters, gradients and optimizer state in host memory
        between uses; the runtime copies the shards in before each gather and the gradients out
        after their reduce (see [Note: offload]).
      experts: the unit holds the expert weights of one mixture-of-experts module (on a mesh
        with an ``ep`` axis): it is gathered and reduced over the expert data-parallel (``shard``)
        axis only, and ``shard_size`` is that axis's size; every other unit is sharded over
        ``ep`` x ``shard`` (see [Note: expert units]).
      top_k: for an expert unit, the experts each token visits (its layer's router's top-k):
        what the expert all-to-alls move (:func:`fsdpfn.step_collectives`); 0 if unknown.
      padded_capacity: for an expert unit whose layer pads each expert's rows to its capacity
        (``fsdpfn.models.MoEConfig(pad_to_capacity=True)``), the capacity factor ``f``: its
        all-to-alls carry ``experts x ceil(f N top_k / experts)`` rows of a call on ``N`` tokens,
        whatever the router chooses, and no counts. ``None``: the rows as routed.
    """

    name: str
    strategy: Strategy  # a str is accepted: __post_init__ converts it
    params: tuple[ParamSpec, ...]
    shard_size: int
    fp8: tuple[str, ...] = ()
    remat: str = "none"
    offload: bool = False
    experts: bool = False
    top_k: int = 0
    padded_capacity: float | None = None

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r} for unit {self.label!r}; choose one of {', '.join(STRATEGIES)}"
            )
        object.__setattr__(self, "strategy", Strategy(self.strategy))
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "fp8", tuple(self.fp8))
        check_policy(self.remat, f"unit {self.label!r}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"unit {self.label!r}: offload must be True or False, got {self.offload!r}")
        if not isinstance(self.experts, bool):
            raise ValueError(f"unit {self.label!r}: experts must be True or False, got {self.experts!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0 or (self.top_k and not self.experts):
            raise ValueError(
                f"unit {self.label!r}: top_k must be an int >= 0, and 0 unless the unit holds experts; got {self.top_k!r}"
            )
        c = self.padded_capacity
        if c is not None and (
            isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0 or not self.top_k
        ):
            raise ValueError(
                f"unit {self.label!r}: padded_capacity must be None or a capacity factor > 0 of an expert unit with a "
                f"top_k; got {c!r} (top_k={self.top_k})"
            )
        # Expert weights are the ones split over ep: their rows and gradients run over other axes.
        mixed = [p.name for p in self.params if (Role.EP in P.split_roles(p)) != self.experts]
        if mixed:
            raise ValueError(
                f"unit {self.label!r} ({'an expert unit' if self.experts else 'a dense unit'}) holds "
                f"{'dense' if self.experts else 'expert'} parameters {mixed[:3]}; expert weights and dense parameters are "
                "reduced over different groups and live in separate units"
            )
        if self.remat != "none" and not self.name:
            raise ValueError(
                "the root unit cannot be rematerialised: its code wraps every other unit. Give remat= to the "
                "units (e.g. remat={'blocks.*': 'full'})"
            )
        if self.fp8 and self.strategy == "replicate":
            raise ValueError(
                f"unit {self.label!r} would gather {list(self.fp8)} in FP8, but its strategy 'replicate' has no all-gather to "
                "carry FP8 bytes. Give it a sharded strategy (zero1/zero2/zero3) or leave it out with "
                "fsdpfn.fp8.Float8GatherPolicy(units=[...])."
            )
        for name in self.fp8:
            if name not in self._by_name:
                raise ValueError(
                    f"unit {self.label!r} lists {name!r} as an FP8 parameter, but it is not one of the unit's parameters"
                )
            if len(self._by_name[name].shape) < 2:
                raise ValueError(
                    f"parameter {name!r} of unit {self.label!r} has shape {self._by_name[name].shape}; only >= 2-D weights gather in FP8"
                )

    @property
    def label(self) -> str:
        return unit_label(self.name)

    @property
    def sharded(self) -> bool:
        return self.strategy.sharded

    @functools.cached_property
    def slots(self) -> dict[str, Slot]:
        """Layout of the gather segment (sharded parameters) then the reduce-only tail
        (replicated parameters), per [Note: flat-buffer layout]."""
        out: dict[str, Slot] = {}
        offset = 0
        for p in self.params:
            if self.sharded and p.shape:
                c = chunk_size(p.rows, self.shard_size)
                out[p.name] = Slot(offset, c, c * p.row_numel, True)
                offset += c * p.row_numel
        for p in self.params:
            if p.name not in out:
                out[p.name] = Slot(offset, p.rows, p.numel, False)
                offset += p.numel
        return out

    @functools.cached_property
    def shard_numel(self) -> int:
        """Elements each rank contributes to the unit's all-gather."""
        return sum(s.size for s in self.slots.values() if s.sharded)

    @functools.cached_property
    def reduce_numel(self) -> int:
        """Elements of each rank's segment of the unit's reduce-scatter (sharded + replicated)."""
        return sum(s.size for s in self.slots.values())

    @functools.cached_property
    def local_numel(self) -> int:
        """Elements of the unit one rank holds between steps (the largest rank's): its segment of the
        reduce-scatter (sharded rows, padding and replicated parameters) for a sharded unit, every
        element otherwise. The one source of a unit's shard bytes per rank."""
        return self.reduce_numel if self.sharded else self.numel

    def local_rows(self, param: str, rank: int) -> tuple[int, int]:
        """``(start, stop)`` rows of ``param`` held by shard rank ``rank``."""
        slot = self.slots[param]
        spec = self.param(param)
        return chunk_bounds(spec.rows, self.shard_size, rank) if slot.sharded else (0, spec.rows)

    def padding(self, rank: int) -> int:
        """Zero elements shard rank ``rank`` adds to its all-gather segment."""
        used = 0
        for p in self.params:
            if self.slots[p.name].sharded:
                start, stop = self.local_rows(p.name, rank)
                used += (stop - start) * p.row_numel
        return self.shard_numel - used

    def param(self, name: str) -> ParamSpec:
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, ParamSpec]:
        return {p.name: p for p in self.params}

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclasses.dataclass(frozen=True)
class PlanValues:
    """The values of a :class:`fsdpfn.Plan` or :class:`fsdpfn.PipelinedPlan` and what they
    derive: layouts, dtypes, codecs, JSON, fingerprint, printout. The two public classes add the
    methods that read other plan modules (see [Note: the plan's class and its values] in
    ``plan_type.py``)."""

    units: tuple[Unit, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    mp: MixedPrecision = MixedPrecision()
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)
    mesh_roles: tuple[str, ...] | None = None
    tp: tuple[tuple[str, str], ...] = ()
    # A PipelinedPlan's fsdpfn.Stages (None on a Plan); typed Any because stages.py sits above
    # this module (it reads unit names), and the check below needs only its fields.
    stages: Any = None
    # (stage, pp size) of a stage's plan (PlanValues.stage_plan): its mesh is one pp rank's part.
    pp_stage: tuple[int, int] | None = None

    def __post_init__(self):
        self._normalise()
        if self.mesh is not None:
            _check_mesh_covers_world(self.mesh, 1 if self.pp_stage is None else self.pp_stage[1])
        axes = self.axes  # validates the mesh: names, roles, one axis per role
        self._check_tp(axes)
        self._check_stages(axes)
        if self.mp.codec is not None:
            codec_factories(self.codec_names, "gather")  # an unregistered name is refused here, before any step
        if Role.EP in axes.roles and not any(u.experts for u in self.units):
            raise ValueError(
                f"the mesh {axes.describe()} has an expert-parallel axis, but the model has no expert weights to split over "
                "it; drop the ep axis (fold it into the data-parallel shard axis), or mark the packed expert weights with "
                "fsdpfn.plan(..., experts=['*.w1', ...])"
            )
        seen: dict[str, str] = {}
        for unit in self.units:
            self._check_unit(unit, axes)
            for p in unit.params:
                if p.name in seen:
                    raise ValueError(
                        f"parameter {p.name!r} is in units {seen[p.name]!r} and {unit.label!r}; a parameter belongs to one unit"
                    )
                seen[p.name] = unit.label
                self._check_param(p, unit, axes)
        self._check_live_mesh()

    def _normalise(self) -> None:
        """Fields as the JSON reader and hand-built plans may give them (lists, role names) in
        the one form equality and the fingerprint read."""
        if self.pp_stage is not None:
            object.__setattr__(self, "pp_stage", (int(self.pp_stage[0]), int(self.pp_stage[1])))
        object.__setattr__(self, "mesh_shape", tuple(self.mesh_shape))
        if self.mesh_dim_names is not None:
            object.__setattr__(self, "mesh_dim_names", tuple(self.mesh_dim_names))
        if self.mesh_roles is not None:
            object.__setattr__(self, "mesh_roles", tuple(str(Role(r)) for r in self.mesh_roles))
        object.__setattr__(self, "tp", tuple((str(m), str(style)) for m, style in self.tp))

    def _check_tp(self, axes: MeshAxes) -> None:
        for module, style in self.tp:
            if tp_style(style) is None:
                raise ValueError(
                    f"tensor-parallel module {module!r}: unknown style {style!r}; choose one of {', '.join(TP_MODULE_STYLES)} "
                    f"or {TP_FUSED_PREFIX}k"
                )
        specs = {p.name: p for u in self.units for p in u.params}
        for module, style in self.tp:
            weight = specs.get(f"{module}.weight")
            parts = None if weight is None else P.placement_of(weight, Role.TP).parts
            if parts is not None and parts != style_row(style).parts:
                raise ValueError(
                    f"tensor-parallel module {module!r} is split {style!r}, but its weight has tp_stride {parts}; "
                    "the plan was edited by hand or written by another fsdpfn. Build it again with fsdpfn.plan(..., tp=...)"
                )
        if self.tp and axes.tp_size == 1 and Role.TP not in axes.roles:
            raise ValueError(
                f"the plan splits modules over tp ({[m for m, _ in self.tp][:3]}...) but the mesh {axes.describe()} has no 'tp' axis"
            )

    def _check_unit(self, unit: Unit, axes: MeshAxes) -> None:
        """A unit's rows, experts, FP8 and dtypes against the mesh and the precision policy."""
        # A unit cuts rows over the data-parallel axes that do not split its parameters.
        rows = P.unit_row_roles(unit, axes)
        want = math.prod(axes.size(r) for r in rows)
        if unit.shard_size != want:
            what = "the mesh's shard axis" if len(rows) == 1 else f"the mesh's {' x '.join(r.value for r in rows)} axes"
            raise ValueError(f"unit {unit.label!r} has shard_size {unit.shard_size}, but {what} has {want} ranks")
        if unit.experts and Role.EP not in axes.roles:
            raise ValueError(
                f"unit {unit.label!r} holds expert weights, but the mesh {axes.describe()} has no 'ep' axis"
            )
        if unit.fp8 and self.mp.fp8 is None:
            raise ValueError(
                f"unit {unit.label!r} lists FP8 parameters but the plan's MixedPrecision has no fp8 policy; "
                "build it with fsdpfn.plan(..., mp=MixedPrecision(..., fp8=...))"
            )
        if unit.fp8 and self.gather_dtype(unit) not in _FP8_INPUT_DTYPES:
            raise ValueError(
                f"unit {unit.label!r} gathers in {_dtype_name(self.gather_dtype(unit))}, which FP8 recipes do not quantize from; "
                "set MixedPrecision(param_dtype=torch.bfloat16) (or float32 / float16)"
            )
        if unit.sharded and self.mp.param_dtype is None and len({p.dtype for p in unit.params}) > 1:
            dtypes = ", ".join(f"{p.name}: {_dtype_name(p.dtype)}" for p in unit.params)
            raise ValueError(
                f"unit {unit.label!r} mixes parameter dtypes ({dtypes}); one flat buffer needs one dtype. "
                "Set MixedPrecision(param_dtype=...) or put the parameters in separate units."
            )

    def _check_param(self, p: ParamSpec, unit: Unit, axes: MeshAxes) -> None:
        """A parameter's placements against the mesh, and its fused parts against its unit's
        sharding."""
        # Every axis a parameter is placed on must be the mesh's (tp always: its activation
        # collectives assume every tp rank holds its part; others where they split it).
        for role in P.PLACED_ROLES:
            size = P.axis_size(p, role)
            if size != axes.size(role) and (role is Role.TP or role in P.split_roles(p)):
                raise ValueError(
                    f"parameter {p.name!r} has {role.value}_size {size}, but the mesh's {role.value} axis has "
                    f"{axes.size(role)} ranks"
                )
        uncut = [e for e in p.placements if not e.placement.cuts_rows and e.size > 1]
        if uncut and unit.slots[p.name].sharded and unit.shard_size > 1:
            raise NotImplementedError(
                f"parameter {p.name!r} is split colwise_fused:{uncut[0].placement.parts} over {uncut[0].axis.value} and would also be sharded over the "
                f"{unit.shard_size} data-parallel ranks of unit {unit.label!r} ({unit.strategy.value}); fused parts cut by "
                "both axes are not supported yet. Give the unit the 'replicate' strategy "
                f"(fsdpfn.plan(..., strategy={{'*': 'zero3', {unit.label!r}: 'replicate'}})), or use a data-parallel axis of 1"
            )

    def _check_live_mesh(self) -> None:
        """A bound mesh has the shape and dim names the plan was built for."""
        if self.mesh is None:
            return
        if tuple(self.mesh.mesh.shape) != self.mesh_shape:
            raise ValueError(
                f"mesh has shape {tuple(self.mesh.mesh.shape)}, but the plan was made for {self.mesh_shape}: a plan's units "
                "and shards are laid out for its mesh. Build the plan again on the new mesh (fsdpfn.plan(model, mesh, ...) with "
                "the same arguments); to move a run to it, save a checkpoint and load it into the plan built for the new mesh"
            )
        if self.mesh_dim_names is not None and len(self.mesh_shape) > 1:
            live = tuple(self.mesh.mesh_dim_names or ())
            if live != self.mesh_dim_names:
                raise ValueError(
                    f"mesh has dim names {live}, but the plan was made for {self.mesh_dim_names}; build the plan on this mesh "
                    "(fsdpfn.plan(model, mesh, ...)), or name the mesh's dims as the plan's"
                )

    def _check_stages(self, axes: MeshAxes) -> None:
        if Role.PP in axes.roles and self.stages is None:
            raise ValueError(
                f"the mesh {axes.describe()} has a pipeline axis, but the plan has no stages; build it with "
                "fsdpfn.pipeline_plan(model, mesh, ...), which splits the units into stages (stages=... to choose how)"
            )
        if self.stages is None:
            return
        if Role.PP not in axes.roles:
            raise ValueError(
                f"the plan has {self.stages.num_stages} pipeline stages, but the mesh {axes.describe()} has no 'pp' "
                "axis; add one, e.g. init_device_mesh('cpu', (pp, dp), mesh_dim_names=('pp', 'dp'))"
            )
        if self.stages.pp_size != axes.pp_size:
            raise ValueError(
                f"the plan's stages are laid out for {self.stages.pp_size} pp ranks, but the mesh's pp axis has "
                f"{axes.pp_size}; build the plan again on this mesh"
            )
        staged = [u for names in self.stages.units for u in names]
        names = [u.name for u in self.units]
        missing = [unit_label(u) for u in names if u not in staged]
        extra = [unit_label(u) for u in staged if u not in names]
        if missing or extra:
            raise ValueError(
                f"the plan's stages do not hold its units: {'in no stage: ' + str(missing) if missing else ''}"
                f"{'; ' if missing and extra else ''}{'not units of the plan: ' + str(extra) if extra else ''}; "
                "every unit belongs to exactly one stage"
            )

    # ---- mesh ----------------------------------------------------------------------------

    @functools.cached_property
    def axes(self) -> MeshAxes:
        """The mesh's named axes and their roles (:class:`fsdpfn.MeshAxes`): every group, size
        and placement is derived from these."""
        roles = None if self.mesh_roles is None else dict(zip(self.mesh_dim_names or ("shard",), self.mesh_roles))
        return MeshAxes.from_names(self.mesh_shape, self.mesh_dim_names, roles)

    @property
    def hsdp(self) -> bool:
        """A replicate axis beside the shard axis: reduce-scatter, then all-reduce."""
        return self.axes.hsdp

    @property
    def shard_size(self) -> int:
        """Ranks on the data-parallel shard axis (``W``)."""
        return self.axes.shard_size

    @property
    def replicate_size(self) -> int:
        """Ranks on the data-parallel replicate axis (1 without one)."""
        return self.axes.replicate_size

    @property
    def tp_size(self) -> int:
        """Ranks on the tensor-parallel axis (1 without one)."""
        return self.axes.tp_size

    @property
    def ep_size(self) -> int:
        """Ranks on the expert-parallel axis (1 without one)."""
        return self.axes.ep_size

    @property
    def cp_size(self) -> int:
        """Ranks on the context-parallel axis (1 without one): each holds ``1 / cp`` of every
        sequence."""
        return self.axes.cp_size

    @property
    def pp_size(self) -> int:
        """Ranks on the pipeline axis (1 without one)."""
        return self.axes.pp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (shard x replicate x ep), which read different examples: the
        global batch is cut into this many slices (:func:`fsdpfn.transforms.dp_rank`)."""
        return self.axes.dp_size

    @property
    def grad_ranks(self) -> int:
        """Ranks gradients are averaged over: ``dp_size`` x ``cp_size``."""
        return self.axes.grad_ranks

    @property
    def world_size(self) -> int:
        """All ranks of the mesh: the product of its dims."""
        return math.prod(self.mesh_shape)

    @functools.cached_property
    def tp_modules(self) -> dict[str, str]:
        """``{module name: style}`` of the tensor-parallel modules."""
        return dict(self.tp)

    def bind(self, mesh) -> "PlanValues":
        """The same plan bound to a live ``DeviceMesh`` (e.g. after :meth:`from_json`)."""
        return dataclasses.replace(self, mesh=mesh)

    # ---- lookups -------------------------------------------------------------------------

    @functools.cached_property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for u in self.units for p in u.params)

    @functools.cached_property
    def _unit_of(self) -> dict[str, Unit]:
        return {p.name: u for u in self.units for p in u.params}

    def unit_of(self, param: str) -> Unit:
        """The unit that owns ``param``."""
        try:
            return self._unit_of[param]
        except KeyError:
            raise ValueError(
                f"parameter {param!r} is not in the plan{_did_you_mean(param, self.param_names)}"
            ) from None

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise ValueError(f"no unit named {name!r} in the plan{_did_you_mean(name, [u.name for u in self.units])}")

    def param(self, name: str) -> ParamSpec:
        return self.unit_of(name).param(name)

    # ---- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The plan as plain data (what :meth:`to_json` writes)."""
        return plan_to_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON (everything but the live mesh). ``Plan.from_json`` inverts it."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable 16-hex-digit hash of the plan (not of the live mesh)."""
        return plan_fingerprint(self)

    # ---- dtypes --------------------------------------------------------------------------

    def gather_dtype(self, unit: Unit) -> torch.dtype:
        """dtype of ``unit``'s all-gather buffer and of its unsharded parameters."""
        return self.mp.param_dtype or unit.params[0].dtype

    def reduce_dtype(self, unit: Unit) -> torch.dtype:
        """dtype gradients of ``unit`` are reduced in."""
        return self.mp.reduce_dtype or self.gather_dtype(unit)

    def fp8_layout(self, unit: Unit) -> Float8Layout | None:
        """The byte layout of ``unit``'s FP8 all-gather (see [Note: FP8 gather layout]), or
        ``None`` if the unit gathers in ``param_dtype`` only."""
        codec = self.gather_codec(unit)
        return codec.layout if isinstance(codec, Float8Codec) else None

    def gather_codec(self, unit: Unit) -> GatherCodec:
        """How ``unit``'s shards travel in its all-gather (a :class:`fsdpfn.GatherCodec`: plain
        rows in the gather dtype, FP8 bytes and scales, or a registered codec; see [Note: codec
        selection] in ``fsdpfn/_codec.py``). The gather, the cost model and the simulator all read
        sizes from it."""
        return cached(self, "_codecs")[0][unit.name]

    def reduce_codec(self, unit: Unit) -> ReduceCodec:
        """How ``unit``'s gradients travel in its reduce (a :class:`fsdpfn.ReduceCodec`: the wire
        and accumulation dtypes, the packing)."""
        return cached(self, "_codecs")[1][unit.name]

    @property
    def codec_names(self) -> tuple[str, ...]:
        """The codec names asked for every unit's codecs, in order ([Note: codec selection])."""
        return ((self.mp.codec,) if self.mp.codec is not None else ()) + ("fp8", "plain")

    @functools.cached_property
    def _codecs(self) -> tuple[dict, dict]:
        out: tuple[dict, dict] = ({}, {})
        for table, side in zip(out, ("gather", "reduce")):
            factories = codec_factories(self.codec_names, side)
            for u in self.units:
                table[u.name] = next(
                    c for c in (f(self, u) for f in factories) if c is not None
                )  # "plain" never declines
        return out

    def gather_bytes(self, unit: Unit) -> int:
        """Bytes each rank contributes to ``unit``'s all-gather (the all-gather moves ``W`` times
        this): ``shard_numel`` elements of the gather dtype, or an FP8 unit's byte segment."""
        return self.gather_codec(unit).nbytes if unit.sharded else 0

    # ---- inspection ----------------------------------------------------------------------

    def __str__(self) -> str:
        if self.axes.legacy and not self.tp:
            mesh = "x".join(map(str, self.mesh_shape)) + (f" {self.mesh_dim_names}" if self.mesh_dim_names else "")
        else:
            mesh = self.axes.describe() + (f", {len(self.tp)} tensor-parallel modules" if self.tp else "")
        mp = f"param_dtype={_dtype_name(self.mp.param_dtype)}, reduce_dtype={_dtype_name(self.mp.reduce_dtype)}"
        fp8 = self.mp.fp8
        if fp8 is not None:
            mp += f", fp8={fp8.recipe.name}" + ("" if fp8.backend == "torch" else f" ({fp8.backend})")
        if self.mp.codec is not None:
            mp += f", codec={self.mp.codec}"
        head = f"{'PipelinedPlan' if self.stages is not None else 'Plan'} {self.fingerprint}: mesh {mesh}, {mp}"
        if self.stages is not None:
            head += f"\n{self.stages.num_stages} pipeline stages: {self.stages}"
        rows = [
            ("unit", "strategy", "params", "elements", "bytes/rank", "padding/rank") + (("fp8 params",) if fp8 else ())
        ]
        for u in self.units:
            itemsize = u.params[0].dtype.itemsize
            pad = max(u.padding(r) for r in range(u.shard_size)) if u.sharded else 0
            extra = (str(len(u.fp8)),) if fp8 else ()
            elements = sum(p.global_numel for p in u.params)
            rows.append(
                (
                    u.label,
                    u.strategy.value,
                    str(len(u.params)),
                    f"{elements:,}",
                    _human(u.local_numel * itemsize),
                    f"{pad:,}",
                )
                + extra
            )
        total = sum(p.global_numel for u in self.units for p in u.params)
        rows.append(
            ("total", "", str(len(self.param_names)), f"{total:,}", "", "")
            + ((str(sum(len(u.fp8) for u in self.units)),) if fp8 else ())
        )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head]
        for i, r in enumerate(rows):
            lines.append(
                "  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip()
            )
            if i == 0 or i == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
