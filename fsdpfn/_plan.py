"""The plan: a frozen, validated, serialisable description of how a model is sharded.

A plan is data. It names the units (groups of parameters gathered and reduced together), each
unit's strategy and flat-buffer layout, the mesh's shape and the mixed-precision policy. The
transforms (:mod:`fsdpfn.transforms`) and the runtime only read it; nothing here talks to other
ranks.

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

Parameters that cannot be split along dim 0 (0-d tensors) are replicated. They are not gathered,
and their gradients ride in the reduce-scatter buffer once in *every* rank's segment, so the
reduce-scatter hands every rank the sum: an all-reduce folded into the same collective.

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
import functools
import hashlib
import json
import math
from typing import Any, Callable, Mapping, Sequence, Union

import fnmatch

import torch
from torch import nn

from fsdpfn.fp8 import Float8GatherPolicy, as_gather_policy, check_te

__all__ = ["MixedPrecision", "ParamSpec", "Unit", "Plan", "plan", "STRATEGIES", "ROOT", "ROOT_LABEL", "chunk_bounds", "chunk_size", "unit_label", "Float8Layout", "ByteSlot"]

# The root unit (the model's own parameters, outside every other unit) has the empty name; it is
# shown and accepted in strategy dicts as ROOT_LABEL.
ROOT = ""
ROOT_LABEL = "<root>"


def chunk_size(rows: int, world: int) -> int:
    """Rows per rank when ``rows`` are split over ``world`` ranks like ``torch.chunk``: ``ceil(rows / world)``."""
    return -(-rows // world) if rows else 0


def chunk_bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s rows under the ``torch.chunk`` split (the split of DTensor's
    ``Shard(0)`` and FSDP2): 5 rows over 4 ranks give 2, 2, 1, 0. The one definition of the split.

    Example:
      >>> [chunk_bounds(5, 4, r) for r in range(4)]
      [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    c = chunk_size(rows, world)
    start = min(rank * c, rows)
    return start, min(start + c, rows)


def unit_label(name: str) -> str:
    """How a unit name is shown: its FQN, or ``"<root>"`` for the root unit."""
    return name or ROOT_LABEL


STRATEGIES = ("replicate", "zero1", "zero2", "zero3")
HSDP_DIM_NAMES = ("replicate", "shard")
_PLAN_FORMAT = 1
_PLAN_FORMAT_FP8 = 2  # a plan with MixedPrecision(fp8=...)
_FP8_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


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

    Example:
      >>> MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
      MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
      >>> MixedPrecision(param_dtype=torch.bfloat16, fp8="mxfp8").fp8.recipe
      MXFP8BlockScaling(scale_mode='rceil')
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    fp8: Float8GatherPolicy | None = None

    def __post_init__(self):
        object.__setattr__(self, "param_dtype", _as_dtype(self.param_dtype, "MixedPrecision.param_dtype"))
        object.__setattr__(self, "reduce_dtype", _as_dtype(self.reduce_dtype, "MixedPrecision.reduce_dtype"))
        object.__setattr__(self, "fp8", as_gather_policy(self.fp8))
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {dtype}")

    def __repr__(self) -> str:
        fp8 = "" if self.fp8 is None else f", fp8={self.fp8!r}"
        return f"MixedPrecision(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}{fp8})"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its path in the model, global shape and (master) dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1


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
      strategy: one of ``replicate``, ``zero1``, ``zero2``, ``zero3``.
      params: the parameters, in registration order.
      shard_size: ranks on the shard axis (``W``).
      fp8: the parameters gathered in FP8 (see [Note: FP8 gather layout]); ``()``: none.
    """

    name: str
    strategy: str
    params: tuple[ParamSpec, ...]
    shard_size: int
    fp8: tuple[str, ...] = ()

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r} for unit {self.label!r}; choose one of {', '.join(STRATEGIES)}"
            )
        object.__setattr__(self, "fp8", tuple(self.fp8))
        if self.fp8 and self.strategy == "replicate":
            raise ValueError(
                f"unit {self.label!r} would gather {list(self.fp8)} in FP8, but its strategy 'replicate' has no all-gather to "
                "carry FP8 bytes. Give it a sharded strategy (zero1/zero2/zero3) or leave it out with "
                "fsdpfn.fp8.Float8GatherPolicy(units=[...])."
            )
        for name in self.fp8:
            if name not in self._by_name:
                raise ValueError(f"unit {self.label!r} lists {name!r} as an FP8 parameter, but it is not one of the unit's parameters")
            if len(self._by_name[name].shape) < 2:
                raise ValueError(f"parameter {name!r} of unit {self.label!r} has shape {self._by_name[name].shape}; only >= 2-D weights gather in FP8")

    @property
    def label(self) -> str:
        return unit_label(self.name)

    @property
    def sharded(self) -> bool:
        return self.strategy != "replicate"

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
class ByteSlot:
    """Where one parameter sits in each rank's byte segment of an FP8 unit's all-gather (see
    [Note: FP8 gather layout]). Offsets and sizes are bytes.

    Attributes:
      fp8: ``True``: E4M3 bytes at ``offset`` and scales at ``scale_offset``; ``False``: the
        parameter's rows in ``param_dtype`` at ``offset``.
      chunk_rows: rows per rank (``ceil(rows / W)``), as in :class:`Slot`.
      size, scale_size: bytes reserved per rank.
    """

    fp8: bool
    chunk_rows: int
    offset: int
    size: int
    scale_offset: int = 0
    scale_size: int = 0


@dataclasses.dataclass(frozen=True)
class Float8Layout:
    """The byte layout of an FP8 unit's all-gather segment: ``slots`` (sharded parameters) and
    ``segment_bytes`` (what each rank contributes; the all-gather moves ``W`` of them).
    ``amax_params``: parameters whose per-tensor scale needs the all-reduced amax first."""

    slots: dict
    segment_bytes: int
    amax_params: tuple[str, ...]


def _fp8_layout(unit: "Unit", policy: Float8GatherPolicy, dtype: torch.dtype) -> Float8Layout:
    recipe = policy.recipe
    fp8 = set(unit.fp8)
    regions = []  # (alignment, parameter, kind, bytes), stably sorted by alignment below
    for p in unit.params:
        slot = unit.slots[p.name]
        if not slot.sharded:
            continue
        if p.name in fp8:
            lines = slot.chunk_rows * (p.row_numel // p.shape[-1])
            regions.append((1, p.name, "data", slot.chunk_rows * p.row_numel))
            scales = lines * recipe.scales_per_line(p.shape[-1]) * recipe.scale_dtype.itemsize
            if scales:
                regions.append((recipe.scale_dtype.itemsize, p.name, "scale", scales))
        else:
            regions.append((dtype.itemsize, p.name, "param", slot.size * dtype.itemsize))
    regions.sort(key=lambda r: -r[0])
    offsets: dict[tuple[str, str], tuple[int, int]] = {}
    offset = 0
    for _, name, kind, nbytes in regions:
        offsets[(name, kind)] = (offset, nbytes)
        offset += nbytes
    align = max((r[0] for r in regions), default=1)
    slots = {}
    for p in unit.params:
        slot = unit.slots[p.name]
        if not slot.sharded:
            continue
        if p.name in fp8:
            off, size = offsets[(p.name, "data")]
            s_off, s_size = offsets.get((p.name, "scale"), (0, 0))
            slots[p.name] = ByteSlot(True, slot.chunk_rows, off, size, s_off, s_size)
        else:
            off, size = offsets[(p.name, "param")]
            slots[p.name] = ByteSlot(False, slot.chunk_rows, off, size)
    amax = tuple(p.name for p in unit.params if p.name in fp8) if recipe.tensorwise else ()
    return Float8Layout(slots, -(-offset // align) * align, amax)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a model is sharded: ordered units, mesh shape, mixed precision. Immutable.

    Build one with :func:`fsdpfn.plan`. ``str(plan)`` prints a table; ``plan.to_json()`` and
    ``Plan.from_json(s, mesh)`` round-trip to an equal plan; ``plan.fingerprint`` is a stable
    hash of everything but the live mesh; ``plan.cost()`` estimates bytes and memory.

    Attributes:
      units: the units, in execution order (root first).
      mesh_shape: ``(W,)`` or ``(R, W)`` for HSDP.
      mesh_dim_names: the mesh's dim names (``("replicate", "shard")`` for HSDP).
      mp: the mixed-precision policy.
      mesh: the live ``DeviceMesh`` (not part of equality or JSON); ``None`` for a plan loaded
        from JSON without one, which can be printed and costed but not executed.
    """

    units: tuple[Unit, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    mp: MixedPrecision = MixedPrecision()
    mesh: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        _check_mesh_shape(self.mesh_shape, self.mesh_dim_names)
        seen: dict[str, str] = {}
        for unit in self.units:
            if unit.shard_size != self.shard_size:
                raise ValueError(
                    f"unit {unit.label!r} has shard_size {unit.shard_size}, but the mesh's shard axis has {self.shard_size} ranks"
                )
            for p in unit.params:
                if p.name in seen:
                    raise ValueError(f"parameter {p.name!r} is in units {seen[p.name]!r} and {unit.label!r}; a parameter belongs to one unit")
                seen[p.name] = unit.label
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
        if self.mesh is not None and tuple(self.mesh.mesh.shape) != self.mesh_shape:
            raise ValueError(f"mesh has shape {tuple(self.mesh.mesh.shape)}, but the plan was made for {self.mesh_shape}")

    # ---- mesh ----------------------------------------------------------------------------

    @property
    def hsdp(self) -> bool:
        return len(self.mesh_shape) == 2

    @property
    def shard_size(self) -> int:
        return self.mesh_shape[-1]

    @property
    def replicate_size(self) -> int:
        return self.mesh_shape[0] if self.hsdp else 1

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: the product of the mesh's dims."""
        return math.prod(self.mesh_shape)

    def bind(self, mesh) -> "Plan":
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
            raise ValueError(f"parameter {param!r} is not in the plan{_did_you_mean(param, self.param_names)}") from None

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise ValueError(f"no unit named {name!r} in the plan{_did_you_mean(name, [u.name for u in self.units])}")

    def param(self, name: str) -> ParamSpec:
        return self.unit_of(name).param(name)

    # ---- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict:
        # FP8 settings appear (and the format becomes 2) only when used, so plans without FP8
        # keep their JSON and fingerprints, and an older fsdpfn refuses an FP8 plan instead of
        # silently running it without FP8.
        d = {
            "format": _PLAN_FORMAT,
            "mesh": {"shape": list(self.mesh_shape), "dim_names": list(self.mesh_dim_names) if self.mesh_dim_names else None},
            "mp": {"param_dtype": _dtype_name(self.mp.param_dtype), "reduce_dtype": _dtype_name(self.mp.reduce_dtype)},
            "units": [
                {
                    "name": u.name,
                    "strategy": u.strategy,
                    "params": [{"name": p.name, "shape": list(p.shape), "dtype": _dtype_name(p.dtype)} for p in u.params],
                    **({"fp8": list(u.fp8)} if u.fp8 else {}),
                }
                for u in self.units
            ],
        }
        if self.mp.fp8 is not None:
            d["format"] = _PLAN_FORMAT_FP8
            d["mp"]["fp8"] = self.mp.fp8.to_dict()
        return d

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON (everything but the live mesh). ``Plan.from_json`` inverts it."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, s: str, mesh=None) -> "Plan":
        """Rebuilds a plan saved with :meth:`to_json`, optionally bound to ``mesh``.

        Example:
          >>> same = Plan.from_json(plan.to_json(), mesh)
          >>> same == plan, same.fingerprint == plan.fingerprint
          (True, True)
        """
        d = json.loads(s)
        if d.get("format") not in (_PLAN_FORMAT, _PLAN_FORMAT_FP8):
            raise ValueError(f"plan JSON has format {d.get('format')!r}; this fsdpfn reads formats {_PLAN_FORMAT} and {_PLAN_FORMAT_FP8}")
        shape = tuple(d["mesh"]["shape"])
        names = tuple(d["mesh"]["dim_names"]) if d["mesh"]["dim_names"] else None
        units = tuple(
            Unit(
                u["name"],
                u["strategy"],
                tuple(ParamSpec(p["name"], tuple(p["shape"]), _dtype_from(p["dtype"])) for p in u["params"]),
                shape[-1],
                tuple(u.get("fp8", ())),
            )
            for u in d["units"]
        )
        fp8 = d["mp"].get("fp8")
        mp = MixedPrecision(
            _dtype_from(d["mp"]["param_dtype"]),
            _dtype_from(d["mp"]["reduce_dtype"]),
            None if fp8 is None else Float8GatherPolicy.from_dict(fp8),
        )
        return cls(units, shape, names, mp, mesh)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable 16-hex-digit hash of the plan (not of the live mesh)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

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
        return self._fp8_layouts.get(unit.name)

    @functools.cached_property
    def _fp8_layouts(self) -> dict[str, Float8Layout]:
        return {u.name: _fp8_layout(u, self.mp.fp8, self.gather_dtype(u)) for u in self.units if u.fp8}

    def gather_bytes(self, unit: Unit) -> int:
        """Bytes each rank contributes to ``unit``'s all-gather (the all-gather moves ``W`` times
        this): ``shard_numel`` elements of the gather dtype, or an FP8 unit's byte segment."""
        layout = self.fp8_layout(unit)
        if layout is not None:
            return layout.segment_bytes
        return unit.shard_numel * self.gather_dtype(unit).itemsize if unit.sharded else 0

    # ---- inspection ----------------------------------------------------------------------

    def cost(self, reshard_after_forward: bool | None = None, prefetch: int = 1):
        """Bytes each collective kind moves per rank per training step, and memory per rank.

        Args:
          reshard_after_forward: whether ``zero3`` units are gathered a second time in backward.
            ``None`` (default): as the runtime's default schedule does, every ``zero3`` unit but
            the root. ``True``: every ``zero3`` unit (the textbook 3x the parameter bytes).
            ``False``: none, as in the pure loop (``torch.func.grad`` over ``unshard``).
          prefetch: units gathered ahead by the runtime; bounds the unsharded memory.

        Returns:
          a :class:`fsdpfn.PlanCost`.
        """
        return _cost_model[0](self, reshard_after_forward, prefetch)

    def __str__(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        names = f" {self.mesh_dim_names}" if self.mesh_dim_names else ""
        mp = f"param_dtype={_dtype_name(self.mp.param_dtype)}, reduce_dtype={_dtype_name(self.mp.reduce_dtype)}"
        fp8 = self.mp.fp8
        if fp8 is not None:
            mp += f", fp8={fp8.recipe.name}" + ("" if fp8.backend == "torch" else f" ({fp8.backend})")
        head = f"Plan {self.fingerprint}: mesh {mesh}{names}, {mp}"
        rows = [("unit", "strategy", "params", "elements", "bytes/rank", "padding/rank") + (("fp8 params",) if fp8 else ())]
        for u in self.units:
            per_rank = u.shard_numel + sum(p.numel for p in u.params if not u.slots[p.name].sharded) if u.sharded else u.numel
            itemsize = u.params[0].dtype.itemsize
            pad = max(u.padding(r) for r in range(self.shard_size)) if u.sharded else 0
            extra = (str(len(u.fp8)),) if fp8 else ()
            rows.append((u.label, u.strategy, str(len(u.params)), f"{u.numel:,}", _human(per_rank * itemsize), f"{pad:,}") + extra)
        total = sum(u.numel for u in self.units)
        rows.append(("total", "", str(len(self.param_names)), f"{total:,}", "", "") + ((str(sum(len(u.fp8) for u in self.units)),) if fp8 else ()))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head]
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip())
            if i == 0 or i == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


# The cost model (``fsdpfn._cost``) reads plans; it registers itself here when fsdpfn is imported,
# so that this module does not import it and dependencies point one way.
_cost_model: list = []


def register_cost_model(fn) -> None:
    """Makes ``fn(plan, reshard_after_forward, prefetch)`` the function behind :meth:`Plan.cost`."""
    _cost_model[:] = [fn]


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def _check_mesh_shape(shape: tuple[int, ...], dim_names: tuple[str, ...] | None) -> None:
    if len(shape) == 1:
        return
    if len(shape) == 2:
        if tuple(dim_names or ()) != HSDP_DIM_NAMES:
            raise ValueError(
                f"a 2-D mesh means HSDP and needs mesh_dim_names=('replicate', 'shard'), got {dim_names!r}; "
                "build it with init_device_mesh('cpu', (R, W), mesh_dim_names=('replicate', 'shard'))"
            )
        return
    raise NotImplementedError(f"meshes with {len(shape)} dims (TP/EP) are not supported yet; pass a 1-D or 2-D HSDP mesh")


def _mesh_shape_and_names(mesh) -> tuple[tuple[int, ...], tuple[str, ...] | None, Any]:
    """``(shape, dim_names, live mesh or None)`` from a DeviceMesh or an abstract shape."""
    if isinstance(mesh, int):
        mesh = (mesh,)
    if isinstance(mesh, (tuple, list)):
        if not mesh or not all(isinstance(d, int) and d >= 1 for d in mesh):
            raise ValueError(f"an abstract mesh is a tuple of positive ints like (W,) or (R, W), got {mesh!r}")
        shape = tuple(mesh)
        return shape, (HSDP_DIM_NAMES if len(shape) == 2 else None), None
    if not hasattr(mesh, "mesh") or not hasattr(mesh, "mesh_dim_names"):
        raise ValueError(f"mesh must be a torch DeviceMesh or a shape tuple like (W,), got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    return tuple(mesh.mesh.shape), names, mesh


UnitsArg = Union[None, Sequence[str], Callable[[str, nn.Module], bool]]
StrategyArg = Union[str, Mapping[str, str]]


def _select_units(model: nn.Module, units: UnitsArg) -> list[str]:
    modules = dict(model.named_modules())
    if units is None:
        names = [
            f"{name}.{child}" if name else child
            for name, mod in model.named_modules()
            if isinstance(mod, nn.ModuleList)
            for child, _ in mod.named_children()
        ]
    elif callable(units):
        names = [name for name, mod in model.named_modules() if name and units(name, mod)]
    elif isinstance(units, str):
        raise ValueError(f"units must be a list of module names, got the string {units!r}; use [{units!r}]")
    else:
        names = list(units)
        for name in names:
            if not isinstance(name, str):
                raise ValueError(f"units must be module names (str), got {name!r}")
            if name not in modules:
                raise ValueError(f"unit {name!r} names no module of {type(model).__name__}{_did_you_mean(name, list(modules))}")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"units lists {dupes} more than once; name each module once")
    return [""] + [n for n in names if n != ""]


def _owner(param_name: str, unit_names: list[str]) -> str:
    best = ""
    for u in unit_names:
        if u and (param_name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _strategy_for(strategy: StrategyArg, unit_names: list[str]) -> dict[str, str]:
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
        return {u: strategy for u in unit_names}
    if not isinstance(strategy, Mapping):
        raise ValueError(f"strategy must be a str or a dict {{unit_name: strategy}}, got {type(strategy).__name__}")
    default = strategy.get("*", "zero3")
    labels = {ROOT_LABEL: ROOT}
    out = {u: default for u in unit_names}
    for key, value in strategy.items():
        if key == "*":
            continue
        unit = labels.get(key, key)
        if unit not in out:
            raise ValueError(f"strategy names unit {key!r}, which is not a unit of this plan{_did_you_mean(key, unit_names)}")
        out[unit] = value
    for unit, value in out.items():
        if value not in STRATEGIES:
            raise ValueError(f"unknown strategy {value!r} for unit {unit_label(unit)!r}; choose one of {', '.join(STRATEGIES)}")
    return out


def plan(
    model: nn.Module,
    mesh,
    units: UnitsArg = None,
    strategy: StrategyArg = "zero3",
    mp: MixedPrecision | None = None,
) -> Plan:
    """Builds a validated :class:`Plan` for ``model`` on ``mesh``.

    Args:
      model: the module to shard. Only its parameters' names, shapes and dtypes are read.
      mesh: a ``DeviceMesh``. 1-D: shard over it. 2-D with dim names ``("replicate", "shard")``:
        HSDP (reduce-scatter on ``shard``, all-reduce on ``replicate``). A shape tuple such as
        ``(1024,)`` or ``(16, 64)`` gives an unbound plan that can be printed, saved and costed
        (e.g. projected to thousands of ranks) but not executed; ``plan.bind(mesh)`` binds it.
      units: ``None`` (every child of every ``nn.ModuleList`` is a unit, the rest is the root
        unit), a list of module FQNs, or ``callable(module_name, module) -> bool``. A parameter
        belongs to the deepest unit that contains it; the root unit takes the rest.
      strategy: ``"replicate"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``, or a dict
        ``{unit_name: strategy}`` (``"<root>"`` or ``""`` for the root, ``"*"`` for the default,
        which is ``"zero3"``).
      mp: a :class:`MixedPrecision` policy (default: none).

    Returns:
      the plan.

    Raises:
      ValueError: a unit naming no module, a parameter shared by two units (tied weights split
        across units), a 2-D mesh with other dim names, an unknown strategy.

    Example:
      >>> p = fsdpfn.plan(model, mesh, strategy={"*": "zero3", "<root>": "zero2"})
      >>> [(u.label, u.strategy) for u in p.units]
      [('<root>', 'zero2'), ('blocks.0', 'zero3'), ('blocks.1', 'zero3')]
      >>> print(fsdpfn.plan(model, (3,)))  # a shape instead of a mesh: printed and costed, not run
      Plan ...: mesh 3, param_dtype=None, reduce_dtype=None
      unit      strategy  params  elements  bytes/rank  padding/rank
      --------  --------  ------  --------  ----------  ------------
      <root>    zero3          5     4,672     6.3 KiB           194
      blocks.0  zero3         12    12,704    16.8 KiB           199
      blocks.1  zero3         12    12,704    16.8 KiB           199
      --------  --------  ------  --------  ----------  ------------
      total                   29    30,080
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"plan() takes the nn.Module to shard, got {type(model).__name__}")
    mp = MixedPrecision() if mp is None else mp
    if not isinstance(mp, MixedPrecision):
        raise ValueError(f"mp must be fsdpfn.MixedPrecision(...), got {type(mp).__name__}")
    shape, names, mesh = _mesh_shape_and_names(mesh)
    _check_mesh_shape(shape, names)

    unit_names = _select_units(model, units)
    strategies = _strategy_for(strategy, unit_names)
    # remove_duplicate=False exposes tied weights under every name they have.
    first_name: dict[int, tuple[str, str]] = {}
    owned: dict[str, list[ParamSpec]] = {u: [] for u in unit_names}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = _owner(name, unit_names)
        if id(p) in first_name:
            other, other_owner = first_name[id(p)]
            if other_owner != owner:
                raise ValueError(
                    f"parameter {name!r} is the same tensor as {other!r} (tied weights), but they fall in units "
                    f"{unit_label(owner)!r} and {unit_label(other_owner)!r}; a parameter is claimed by two units. "
                    "Put both modules in one unit (e.g. leave them in the root unit)."
                )
            continue
        first_name[id(p)] = (name, owner)
        owned[owner].append(ParamSpec(name, tuple(p.shape), p.dtype))

    fp8 = _fp8_params(model, mp, owned, strategies, unit_names) if mp.fp8 is not None else {}
    shard_size = shape[-1]
    built = tuple(Unit(u, strategies[u], tuple(owned[u]), shard_size, fp8.get(u, ())) for u in unit_names if owned[u])
    return Plan(built, shape, names, mp, mesh)


def _fp8_params(model: nn.Module, mp: MixedPrecision, owned: dict[str, list[ParamSpec]], strategies: dict[str, str],
                unit_names: list[str]) -> dict[str, tuple[str, ...]]:
    """Each unit's parameters gathered in FP8 under ``mp.fp8``, with every setting that cannot
    work refused here, on every rank, before any collective."""
    policy = mp.fp8
    modules = dict(model.named_modules())
    all_names, embedded, by_name = [], set(), {}
    for name, p in model.named_parameters(remove_duplicate=False):
        all_names.append(name)
        by_name[name] = p
        if isinstance(modules[name.rpartition(".")[0]], (nn.Embedding, nn.EmbeddingBag)):
            embedded.add(id(p))  # a weight tied to an embedding stays high precision under every name
    for pat in policy.exclude:
        if not any(fnmatch.fnmatchcase(n, pat) for n in all_names):
            raise ValueError(f"Float8GatherPolicy(exclude=...) pattern {pat!r} matches no parameter{_did_you_mean(pat, all_names)}")
    if policy.units is None:
        chosen = set(unit_names)
    else:
        chosen = set()
        for label in policy.units:
            unit = ROOT if label == ROOT_LABEL else label
            if unit not in unit_names:
                raise ValueError(f"Float8GatherPolicy(units=...) names {label!r}, which is not a unit of this plan{_did_you_mean(label, [unit_label(u) for u in unit_names])}")
            chosen.add(unit)
    out: dict[str, tuple[str, ...]] = {}
    for u in unit_names:
        if u not in chosen:
            continue
        eligible = tuple(
            p.name for p in owned[u]
            if len(p.shape) >= 2 and p.numel > 0 and id(by_name[p.name]) not in embedded and not policy.excludes(p.name)
        )
        if not eligible:
            if policy.units is not None:
                shapes = ", ".join(f"{p.name} {p.shape}" for p in owned[u]) or "none"
                raise ValueError(
                    f"Float8GatherPolicy(units=...) names unit {unit_label(u)!r}, which has no weight to gather in FP8 (a >= 2-D "
                    f"parameter that is not an embedding and not excluded; its parameters: {shapes}). Leave it out of units."
                )
            continue
        if strategies[u] == "replicate":
            raise ValueError(
                f"unit {unit_label(u)!r} uses strategy 'replicate', which has no all-gather to carry FP8 weights, but "
                f"MixedPrecision(fp8=...) selects {list(eligible)}. Shard it (zero1/zero2/zero3) or leave it out with "
                "fsdpfn.fp8.Float8GatherPolicy(units=[...])."
            )
        dtype = mp.param_dtype or by_name[eligible[0]].dtype
        if dtype not in _FP8_INPUT_DTYPES:
            raise ValueError(
                f"unit {unit_label(u)!r} gathers in {_dtype_name(dtype)}; FP8 recipes quantize from float32, bfloat16 or float16. "
                "Set MixedPrecision(param_dtype=torch.bfloat16)."
            )
        out[u] = eligible
    if not out:
        raise ValueError(
            "MixedPrecision(fp8=...) selects no parameter: no unit has a >= 2-D weight that is not an embedding and not "
            "excluded. Drop fp8=, or check Float8GatherPolicy(units=..., exclude=...)."
        )
    if policy.backend == "te":
        check_te(policy.recipe, [(n, by_name[n].shape) for names in out.values() for n in names])
    return out
